"""Where an export or ``--save-hf`` folder goes: only a folder fsdp2lab wrote is ever replaced.

Every such folder carries the mark ``.fsdp2lab-export`` (JSON: the host and process that wrote
it), written into its temporary folder ``.OUT.tmp-HOST-PID`` beside the target before anything
else. The finished folder is put in place by swapping it with the old one in one atomic step
(``renameat2(RENAME_EXCHANGE)``) where the system allows it; elsewhere the old folder is first
renamed aside to ``.OUT.old-HOST-PID``. Before each save into a folder, :func:`tidy` renames back
an old folder set aside by a save that died before its new one was in place, and removes the
other marked temporaries of processes of this host that no longer run: at every moment a crash
can hit, a good folder is under the target's name, or the next save or run puts it back. A
temporary of another host is left alone: whether its process runs cannot be seen from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
from pathlib import Path

from fsdp2lab.checkpoint import layout
from fsdp2lab.errors import UsageError
from fsdp2lab.runtime import logs

log = logs.get_logger(__name__)
MARK = ".fsdp2lab-export"
_LEFTOVER = re.compile(r"\.(?P<target>.+)\.(?P<kind>tmp|old|deleting)-(?P<host>.+)-(?P<pid>\d+)")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def is_marked(folder: Path) -> bool:
    return layout.is_own(folder, MARK)


def check_folder(out: Path, what: str = "export to") -> None:
    """A UsageError when ``out`` is not a folder a save may replace: a file, a link, or a folder
    holding files without fsdp2lab's mark (an empty folder is taken); or when the nearest
    folder above it is not one this process can write in."""
    if out.is_symlink():
        raise UsageError(f"{what} {out} refused: it is a symbolic link; give the folder itself")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a folder")
    if out.is_dir() and not is_marked(out):
        names = sorted(p.name for p in out.iterdir())
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise UsageError(
                f"{what} {out} refused: fsdp2lab did not write that folder (it has no {MARK} "
                f"mark) and it holds {shown}; give a new or empty folder"
            )
    _check_writable(_existing_parent(out), out, what)


def check_space(out: Path, needed: int, what: str) -> None:
    """A UsageError when the file system ``out`` goes to has less than ``needed`` bytes free."""
    where = _existing_parent(out)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise UsageError(
            f"{what} {out}: the save needs {_size(needed)} free (its shards and the joined files), "
            f"but {where} has {_size(free)} free"
        )


def new_folder(out: Path) -> Path:
    """The temporary folder ``out`` is written under, created empty and marked."""
    tmp = layout.temporary_name(out)
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from a save that failed
    layout.mark_own(tmp, MARK)
    return tmp


def put_in_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``; the folder there before is replaced, and
    removed once the new one is in place."""
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        layout._fsync_dir(out.parent)
        return
    old = tmp if _exchange(tmp, out) else _set_aside(out)
    if old is not tmp:
        os.rename(tmp, out)
    layout._fsync_dir(out.parent)
    remove(old)


def tidy(parent: Path) -> list[str]:
    """Put back the folders a save set aside and died before replacing, and remove the other
    marked temporaries of this host's processes that no longer run, in ``parent``. Logs and
    returns a line on each."""
    done: list[str] = []
    if not parent.is_dir():
        return done
    for entry in sorted(parent.iterdir()):
        match = _LEFTOVER.fullmatch(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir() or not is_marked(entry):
            continue
        host, pid = match["host"], int(match["pid"])
        if _runs(host, pid):
            continue
        target = parent / match["target"]
        why = f"left by process {pid} on {host}, which no longer runs"
        if match["kind"] == "old" and not (target.exists() or target.is_symlink()):
            with contextlib.suppress(OSError):  # another process put it back first
                os.rename(entry, target)
                done.append(f"put back {target} from {entry.name}, set aside by a save {why}")
        elif remove(entry):
            done.append(f"removed {entry}, an unfinished save {why}")
    for line in done:
        log.info(f"fsdp2lab: {line}")
    return done


def remove(folder: Path) -> bool:
    """Delete a marked folder: renamed away first (of two processes, one gets it), its mark
    deleted last, so a crash half way leaves a marked temporary for the next :func:`tidy`."""
    doomed = layout.temporary_name(folder, "deleting")
    try:
        os.rename(folder, doomed)
    except OSError:
        return False
    for child in doomed.iterdir():
        if child.name == MARK:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (doomed / MARK).unlink(missing_ok=True)
        doomed.rmdir()
    return True


def _set_aside(out: Path) -> Path:
    """Rename ``out`` to a marked temporary name beside it (where no atomic swap exists)."""
    old = layout.temporary_name(out, "old")
    os.rename(out, old)
    return old


@functools.cache
def _renameat2():
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically; False where this system or file system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _runs(host: str, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` may still run (another host's: cannot tell, so yes)."""
    if host != os.uname().nodename:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _existing_parent(out: Path) -> Path:
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _check_writable(parent: Path, out: Path, what: str) -> None:
    if not parent.is_dir():
        raise UsageError(f"{what} {out} refused: {parent} is not a folder")
    probe = layout.temporary_name(parent / "write-test")
    try:
        probe.write_bytes(b"fsdp2lab")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"{what} {out} refused: {parent} is not writable: {e.strerror or e}"
        ) from None


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
