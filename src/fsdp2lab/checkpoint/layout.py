"""The checkpoint folder on disk: ``DIR/step-N`` folders, their ``COMPLETE`` mark, ``DIR/latest``.

A step folder holds DCP's files (``.metadata`` and one ``__R_0.distcp`` per rank), the mark
``.fsdp2lab-save`` written when its save starts (only folders carrying it are ever deleted) and,
once every rank has written, a ``COMPLETE`` mark: JSON with what was saved and the size of every
file. Only a ``COMPLETE`` folder counts as a checkpoint. A run holds ``DIR/.lock`` (``flock``)
while it uses the folder. A checkpoint is read as data: ``.metadata`` through a restricted
unpickler, nothing in it is run, and what it claims is checked before anything is read or
allocated (its files are in the folder, each tensor fits in the bytes it is stored in).
Everything here is plain file handling: no process group.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp2lab.errors import UsageError

if TYPE_CHECKING:  # torch comes with reading a checkpoint's metadata (read_metadata), not before
    from torch.distributed.checkpoint.metadata import Metadata

COMPLETE = "COMPLETE"
LATEST = "latest"
METADATA = ".metadata"
OWN_SAVE = ".fsdp2lab-save"  # written when a save starts: this tool's folder, its to delete
LOCK = ".lock"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"step-(\d+)")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}"


def step_of(path: Path) -> int | None:
    match = _STEP_RE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_folders(root: str | os.PathLike) -> list[Path]:
    """The ``step-N`` folders in ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def complete_folders(root: str | os.PathLike) -> list[Path]:
    return [p for p in step_folders(root) if is_complete(p)]


def temporary_name(path: Path, kind: str = "tmp") -> Path:
    """A hidden name beside ``path`` that no other process writes, on this host or another that
    shares the folder (process ids repeat across hosts and PID namespaces; host names don't)."""
    return path.with_name(f".{path.name}.{kind}-{os.uname().nodename}-{os.getpid()}")


def _write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file, flush it to disk, then rename it over ``path``."""
    tmp = temporary_name(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_own(path: Path, mark: str = OWN_SAVE) -> None:
    """Create folder ``path`` (if needed) and mark it as a save of this tool (``mark``: a step
    folder's, or an export's), before any of the save's files are written."""
    path.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"host": os.uname().nodename, "pid": os.getpid()}) + "\n"
    _write_atomic(path / mark, text)


def is_own(path: Path, mark: str = OWN_SAVE) -> bool:
    return (path / mark).is_file()


def mark_complete(path: Path, info: dict) -> dict:
    """Record every file's size with ``info`` and mark ``path`` complete (atomically)."""
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    marker = {"format": FORMAT_VERSION, **info, "files": files}
    _write_atomic(path / COMPLETE, json.dumps(marker, indent=1, sort_keys=True) + "\n")
    return marker


def set_latest(root: Path, path: Path) -> None:
    _write_atomic(root / LATEST, path.name + "\n")


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def remove(path: Path) -> None:
    """Delete a step folder of this tool's: renamed away first, so a crash never leaves half of a
    marked one. A folder without the ``.fsdp2lab-save`` mark is left alone."""
    if not is_own(path):
        return
    doomed = temporary_name(path, "deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints, and the unfinished saves
    older than the newest one. Returns what was removed."""
    complete = complete_folders(root)
    if not complete:
        return []
    keep = set(complete[-keep_last:])
    newest = step_of(complete[-1])
    doomed = [p for p in step_folders(root) if p not in keep and step_of(p) < newest and is_own(p)]
    for path in doomed:
        remove(path)
    return doomed


def remove_unfinished(root: Path) -> list[Path]:
    """Remove this tool's step folders without a ``COMPLETE`` mark (its interrupted saves) and
    leftovers of interrupted deletions. Another tool's ``step-N`` folder stays."""
    root = Path(root)
    doomed = [p for p in step_folders(root) if not is_complete(p) and is_own(p)]
    for path in doomed:
        remove(path)
    for leftover in root.glob(".step-*.deleting-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return doomed


def check_writable(root: str | os.PathLike) -> None:
    """Create ``root`` if needed and write a file in it: a UsageError now, not at the first save."""
    root = Path(root)
    probe = temporary_name(root / "write-test")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"fsdp2lab")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise UsageError(f"--ckpt-dir {root} is not writable: {reason}") from None


def lock(root: str | os.PathLike):
    """Hold ``root/.lock`` (an exclusive ``flock``; the file is never written) for as long as the
    returned file stays open: one run per checkpoint folder. A UsageError when another run
    holds it."""
    path = Path(root) / LOCK
    Path(root).mkdir(parents=True, exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 (held open for the run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise UsageError(
            f"--ckpt-dir {root} is in use by another run (it holds {path}; `fuser {path}` "
            "names it on its host); wait for it to end or use another --ckpt-dir"
        ) from None
    except OSError as e:
        f.close()
        raise UsageError(f"--ckpt-dir {root}: cannot lock {path}: {e.strerror or e}") from None
    return f


# ---------------------------------------------------------------------------- reading
@dataclass
class Checkpoint:
    """A complete checkpoint that passed every check: its folder, mark and DCP metadata."""

    path: Path
    marker: dict
    metadata: Metadata

    @property
    def step(self) -> int:
        return int(self.marker["step"])

    @property
    def contents(self) -> list[str]:
        return list(self.marker["contents"])


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Check a step folder thoroughly before anything is loaded; a UsageError names the problem."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise UsageError(f"{path} is not a checkpoint folder (expected DIR/step-N)")
    if not is_complete(path):
        raise UsageError(
            f"checkpoint {path} is incomplete: it has no {COMPLETE} mark, so its save did not finish"
        )
    try:
        marker = json.loads((path / COMPLETE).read_text())
        files = dict(marker["files"])
        int(marker["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"checkpoint {path}: its {COMPLETE} mark is damaged ({e})") from None
    if not (path / METADATA).is_file():
        raise UsageError(
            f"checkpoint {path} has no {METADATA} file (DCP's index of the shards), so it cannot "
            "be read"
        )
    for name, size in files.items():
        if not _is_plain_name(str(name)):
            raise UsageError(
                f"checkpoint {path}: its {COMPLETE} mark names a file {name!r} elsewhere"
            )
        _check_file(path, name, size)
    metadata = read_metadata(path)
    try:
        _check_index(path, metadata)
    except (AttributeError, TypeError, ValueError) as e:  # fields of the wrong type
        raise UsageError(
            f"checkpoint {path}: {METADATA} is damaged ({type(e).__name__}: {e})"
        ) from None
    return Checkpoint(path, marker, metadata)


def _check_index(folder: Path, metadata: Metadata) -> None:
    """DCP's index, checked before anything is read or allocated: each storage entry a file name
    of the step folder (no path), untransformed (fsdp2lab compresses nothing), its byte range
    inside that file; each tensor no bigger than the bytes its chunks are stored in."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    ends: dict[str, int] = {}
    stored: dict[MetadataIndex, tuple[str, int]] = {}
    for index, info in (metadata.storage_data or {}).items():
        name, offset, length = info.relative_path, int(info.offset), int(info.length)
        if not isinstance(name, str) or not _is_plain_name(name):
            raise UsageError(
                f"checkpoint {folder}: {METADATA} names the shard file {name!r}, which is not a "
                "file name in the checkpoint's folder: refused, nothing is read outside it"
            )
        if getattr(info, "transform_descriptors", None):
            raise UsageError(
                f"checkpoint {folder}: {METADATA} stores {index.fqn} transformed "
                f"({', '.join(map(str, info.transform_descriptors))}), which fsdp2lab does not read"
            )
        if offset < 0 or length < 0:
            raise UsageError(f"checkpoint {folder}: {METADATA} gives {index.fqn} a negative range")
        ends[name] = max(ends.get(name, 0), offset + length)
        stored[index] = (name, length)
    for name, end in ends.items():  # every byte range inside its file
        _check_file(folder, name, None, at_least=end)
    file_sizes = {name: (folder / name).stat().st_size for name in ends}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        shape, dtype = tuple(entry.size), entry.properties.dtype
        if not isinstance(dtype, torch.dtype) or not all(
            isinstance(d, int) and d >= 0 for d in shape
        ):
            raise UsageError(f"checkpoint {folder}: {METADATA} gives {key} as {shape} {dtype}")
        nbytes = math.prod(shape) * dtype.itemsize
        chunks = {MetadataIndex(key, chunk.offsets) for chunk in entry.chunks}
        places = [stored[chunk] for chunk in chunks if chunk in stored]
        held = min(
            sum(length for _, length in places),
            sum(file_sizes[name] for name in {name for name, _ in places}),
        )
        if nbytes > held:
            raise UsageError(
                f"checkpoint {folder}: {METADATA} gives {key} as {list(shape)} "
                f"{str(dtype).removeprefix('torch.')} ({nbytes:,} bytes), but its chunks are "
                f"stored in {held:,} bytes: a damaged or altered checkpoint, not read"
            )


def _is_plain_name(name: str) -> bool:
    """A file name with no folder in it: not empty, ``.`` or ``..``, no separator."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def read_metadata(path: Path) -> Metadata:
    """A step folder's DCP metadata, read without running code; a UsageError if it is not."""
    from fsdp2lab.runtime.torch_compat import RefusedPickle, SafeFileSystemReader

    try:
        return SafeFileSystemReader(path).read_metadata()
    except RefusedPickle as e:
        raise UsageError(
            f"checkpoint {path}: {METADATA} is not DCP metadata ({e}): refused, a checkpoint "
            "is read as data and nothing in it is run"
        ) from None
    except Exception as e:
        raise UsageError(f"checkpoint {path}: {METADATA} cannot be read ({e})") from None


def read_error(error: BaseException) -> str:
    """One line on why DCP could not read a checkpoint: the first rank's own error (DCP wraps
    them in a ``CheckpointException``); a value that is not plain data says it was refused."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    text = str(error).strip()
    if isinstance(error, pickle.UnpicklingError):
        named = re.search(r"unsupported GLOBAL (\S+)", text)
        what = f"it names {named.group(1)}" if named else "not plain data"
        return f"a value in it is refused ({what}): it is read as data, nothing in it is run"
    return (text.splitlines() or [type(error).__name__])[0]


def _check_file(folder: Path, name: str, size: int | None, at_least: int = 0) -> None:
    file = folder / name
    if not file.is_file():
        raise UsageError(f"checkpoint {folder}: shard file {file} is missing")
    actual = file.stat().st_size
    if (size is not None and actual != size) or actual < at_least:
        expected = size if size is not None else at_least
        raise UsageError(
            f"checkpoint {folder}: shard file {file} is truncated or damaged "
            f"({actual} bytes, {expected} when saved)"
        )


def find_checkpoint(path: str | os.PathLike, notes: list[str]) -> Checkpoint:
    """``path`` as a step folder, or as a checkpoint directory: its newest complete checkpoint.

    An incomplete newer folder is skipped with a note; a complete but damaged one is an error.
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"checkpoint not found: {path}")
    if step_of(path) is not None or (path / METADATA).exists() or (path / COMPLETE).exists():
        return open_checkpoint(path)
    folders = step_folders(path)
    if not folders:
        raise UsageError(f"no checkpoint in {path} (no step-N folders)")
    for folder in reversed(folders):
        if is_complete(folder):
            return open_checkpoint(folder)
        notes.append(
            f"skipping incomplete checkpoint {folder} (no {COMPLETE} mark: its save did not finish)"
        )
    raise UsageError(f"no complete checkpoint in {path}: every step-N folder lacks its mark")
