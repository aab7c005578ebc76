"""Export a DCP checkpoint's model as safetensors through DCP's Hugging Face storage.

Each tensor is read from the checkpoint on its own (``dcp.load`` of that one key) and handed to
DCP's ``HuggingFaceStorageWriter`` in files of consecutive tensors no bigger together than the
largest one; torch's consolidation then joins them into the output files, one tensor at a time:
the exporting process holds at most the largest tensor's bytes at a time.
Where torch's consolidation cannot (a tensor that is not floating point, or a torch without it:
``runtime.torch_compat.hf_consolidation_missing``, said in one line) each output file is written
whole by the writer: the process holds one output file's tensors at a time.

Two layouts:

- ``OUT.safetensors``: one file with every model tensor under its name in the model;
- ``OUT/`` (a folder): what Hugging Face ``save_pretrained`` writes: ``model.safetensors``, or
  ``model-0000K-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` above
  ``max_shard_size``; with a Hugging Face config (given, or the one a Hugging Face model's run
  recorded in the checkpoint) also ``config.json``, and tied weights stored
  once (``from_pretrained`` ties them again); for a pretrained model's run (``--model hf:PATH``)
  also the tokenizer's files and ``generation_config.json`` beside the weights, each only from the
  folder the run recorded and only while its sha256 is the one recorded. That needs
  ``transformers`` (the ``hf`` extra): it builds the model on the meta device to learn which
  weights are tied and checks the names.

Floating tensors are written in the dtype :func:`save_dtype` picks (``--save-dtype``, else the
source model's as its Hugging Face config names it, else as trained), each file with the metadata
``{"format": "pt"}`` as ``save_pretrained`` writes it.

A file or folder is written whole under a temporary name and renamed into place
(:mod:`fsdp2lab.checkpoint.targets`): an earlier export there is replaced; a folder without
fsdp2lab's mark is refused, as are the checkpoint's folders and the model folder the run started
from, and a save that would not fit in the free space.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp2lab.checkpoint import layout, targets
from fsdp2lab.checkpoint.export import _one_process
from fsdp2lab.checkpoint.state import GENERATION_FILE, MODEL, TOKENIZER_EXTRAS, saved_run
from fsdp2lab.data.tokens import TOKENIZER_FILES
from fsdp2lab.errors import UsageError
from fsdp2lab.parallel.precision import DTYPES
from fsdp2lab.runtime.torch_compat import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    hf_consolidate,
    hf_consolidation_missing,
    hf_shard_writer,
    notice,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's adapter folder
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's "5GB"
HF_HINT = 'pip install -e ".[hf]"'
SHARDS = "sharded"  # the writer's files of single tensors, joined into the output files
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


@dataclass(frozen=True)
class Entry:
    """One model tensor: its name in the output, its key in the checkpoint, shape, dtype as read,
    and the dtype it is written in (None: as read)."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    saved_as: torch.dtype | None = None

    @property
    def out_dtype(self) -> torch.dtype:
        return self.saved_as or self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes written."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.out_dtype.itemsize


# A Hugging Face config's dtype names (``dtype``, ``torch_dtype``) of the dtypes a save writes.
_NAMED_DTYPES = {str(d).removeprefix("torch."): d for d in DTYPES.values()}


def save_dtype(choice: str | None, hf_config: dict | None) -> torch.dtype | None:
    """The dtype a save writes floating tensors in: ``choice`` (``--save-dtype``: fp32, bf16,
    fp16), else the one the source model's Hugging Face config names (``dtype``, ``torch_dtype``:
    what ``save_pretrained`` keeps), else None: as trained (the fp32 master weights)."""
    if choice is not None:
        return DTYPES[choice]
    config = hf_config or {}
    return _NAMED_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))


def saved_as(entries: list[Entry], dtype: torch.dtype | None) -> list[Entry]:
    """``entries`` with their floating ones written in ``dtype`` (None: as read)."""
    if dtype is None:
        return entries
    return [
        dataclasses.replace(e, saved_as=dtype) if e.dtype.is_floating_point else e for e in entries
    ]


@dataclass
class Exported:
    """What an export wrote."""

    ckpt: layout.Checkpoint
    files: list[Path]
    tensors: int
    total_bytes: int
    tied: dict[str, str] = field(default_factory=dict)  # left out -> the name it is tied to


def model_entries(ckpt: layout.Checkpoint) -> list[Entry]:
    """The checkpoint's model tensors, in the model's order, from its metadata alone."""
    prefix = MODEL + "."
    entries = [
        Entry(key[len(prefix) :], key, tuple(entry.size), entry.properties.dtype)
        for key, entry in ckpt.metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    ]
    if not entries:
        raise UsageError(f"checkpoint {ckpt.path} holds no model tensors")
    for e in entries:
        if e.dtype not in _DTYPES:
            raise UsageError(f"{e.name} is {e.dtype}, which safetensors cannot hold")
    return entries


# ---------------------------------------------------------------------------- writing
def _checked(entry: Entry, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, read for ``entry``, in the dtype it is written in."""
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        raise UsageError(
            f"{entry.name}: read {tuple(tensor.shape)} {tensor.dtype}, "
            f"expected {entry.shape} {entry.dtype}"
        )
    return tensor.to(entry.out_dtype)


def _dcp_write(state: dict[str, torch.Tensor], writer) -> None:
    with _one_process():
        dcp.save(state, storage_writer=writer, no_dist=True)


def pieces(entries: list[Entry]) -> list[list[Entry]]:
    """The files DCP's writer gets before they are joined: consecutive groups of tensors no
    bigger together than the largest (fewer files than one a tensor, as little memory)."""
    return plan_shards(entries, max(e.nbytes for e in entries))


def write_weights(
    out: Path, shards: list[list[Entry]], load: Callable[[Entry], torch.Tensor]
) -> list[Path]:
    """``shards`` (each tensor read by ``load`` in turn) into the folder ``out`` as
    ``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json``, through DCP's
    Hugging Face storage, each tensor in its ``out_dtype``. Returns the files."""
    entries = [e for shard in shards for e in shard]
    fqn_to_index = {e.name: k for k, shard in enumerate(shards, 1) for e in shard}
    missing = hf_consolidation_missing({e.out_dtype for e in entries})
    if missing is None:  # at most the largest tensor's bytes at a time
        parts = pieces(entries)
        index_of = {e.name: i for i, part in enumerate(parts, 1) for e in part}
        for part in parts:
            state = {e.name: _checked(e, load(e)) for e in part}
            _dcp_write(state, hf_shard_writer(str(out / SHARDS), index_of))
            del state
        join_shards(out / SHARDS, out, fqn_to_index)
        shutil.rmtree(out / SHARDS)
    else:  # one output file at a time
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        notice(
            f"export_whole_files {missing}", f"{missing}: each safetensors file is written whole"
        )
        for shard in shards:
            state = {e.name: _checked(e, load(e)) for e in shard}
            _dcp_write(state, HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=fqn_to_index))
            del state
        names = {
            k: f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)
        }
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {n: names[k] for n, k in sorted(fqn_to_index.items())},
        }
        layout._write_atomic(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    files = sorted(out.glob("model-*-of-*.safetensors"))
    for file in files:
        pt_format(file)
    return files + [out / INDEX_FILE]


def join_shards(shards: Path, out: Path, fqn_to_index: dict[str, int]) -> None:
    """Join the writer's files in ``shards`` into whole tensors in ``out`` (torch's consolidation:
    :func:`hf_consolidate`), each file marked :func:`pt_format`."""
    hf_consolidate(str(shards), str(out), fqn_to_index)
    for file in sorted(out.glob("model-*-of-*.safetensors")):
        pt_format(file)


def pt_format(file: Path) -> None:
    """Give safetensors ``file`` the metadata ``{"format": "pt"}`` (what ``save_pretrained``
    writes and older transformers require; torch's consolidation writes none): its header
    rewritten, the tensors' bytes copied after it. A file that has it is left as it is."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        metadata = header.pop("__metadata__", None) or {}
        if metadata.get("format") == "pt":
            return
        text = json.dumps({"__metadata__": {**metadata, "format": "pt"}, **header}).encode()
        text += b" " * (-len(text) % 8)  # the tensors 8-byte aligned, as safetensors pads it
        rewritten = file.with_name(file.name + ".tmp")
        with open(rewritten, "wb") as g:
            g.write(struct.pack("<Q", len(text)) + text)
            shutil.copyfileobj(f, g, 16 << 20)
    os.replace(rewritten, file)


# ---------------------------------------------------------------------------- reading
class _Reader(SafeFileSystemReader):
    """A reader that reads the checkpoint's ``.metadata`` once, not once per tensor (and, as
    every reader here, runs no code from it)."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def load_tensor(reader: dcp.FileSystemReader, entry: Entry) -> torch.Tensor:
    """Just this one tensor of the checkpoint, whole, on CPU (DCP joins its shards)."""
    template = {entry.key: torch.empty(entry.shape, dtype=entry.dtype)}
    try:
        with _one_process():
            dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:
        why = layout.read_error(e)
        raise UsageError(
            f"checkpoint {reader.path}: {entry.name} could not be read: {why}"
        ) from None
    return template[entry.key]


# ---------------------------------------------------------------------------- layouts
def plan_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Consecutive groups of at most ``max_shard_size`` bytes (a bigger tensor alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def meta_hf_model(model_type: str, settings: dict) -> tuple[object, torch.nn.Module]:
    """The transformers config of ``model_type`` with ``settings``, and its causal LM built on the
    meta device (``architectures`` filled in). A UsageError when the settings ask for code or a
    hub kernel, or transformers cannot build it."""
    try:
        import transformers
    except ImportError:
        raise UsageError(
            f"exporting with a Hugging Face config needs transformers: {HF_HINT}"
        ) from None
    from fsdp2lab.models.hf import check_settings

    check_settings(settings, "no Hugging Face causal LM from this config", "the config")
    try:  # for_model takes no trust_remote_code (it would become a setting): checked above
        config = transformers.AutoConfig.for_model(model_type, **settings)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"no Hugging Face causal LM from this config: {first}") from None
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    return config, model


def _hf_model_info(hf_config: dict, entries: list[Entry]) -> tuple[object, dict[str, str]]:
    """The transformers config to write, and which names are tied to which (from the model
    built on the meta device). A UsageError when the checkpoint does not fit the model."""
    settings = dict(hf_config)
    model_type = settings.pop("model_type", None)
    if not model_type:
        raise UsageError("the Hugging Face config has no model_type")
    # The files' dtype, so that from_pretrained (dtype "auto") keeps the weights as saved.
    floats = [e.out_dtype for e in entries if e.out_dtype.is_floating_point]
    settings.pop("dtype", None)
    settings.pop("torch_dtype", None)
    if floats:
        widest = max(set(floats), key=lambda d: sum(e.nbytes for e in entries if e.out_dtype == d))
        settings["torch_dtype"] = str(widest).removeprefix("torch.")
    config, model = meta_hf_model(model_type, settings)
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner:
            tied[name] = owner[id(param)]
        else:
            owner[id(param)] = name
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    have = {e.name: e.shape for e in entries}
    missing = sorted(k for k in expected if k not in have and k not in tied)
    extra = sorted(k for k in have if k not in expected)
    differ = sorted(k for k in expected if k in have and have[k] != expected[k])
    if missing or extra or differ:
        problems = []
        for what, names in (
            ("of the model's tensors are not in the checkpoint", missing),
            ("of the checkpoint's tensors are not in the model", extra),
            ("shapes differ", differ),
        ):
            if names:
                shown = ", ".join(names[:3]) + (f", and {len(names) - 3} more" * (len(names) > 3))
                problems.append(f"{len(names)} {what} ({shown})")
        raise UsageError(
            f"the checkpoint does not fit the Hugging Face {type(model).__name__}: "
            + "; ".join(problems)
        )
    return config, {k: v for k, v in tied.items() if k in have}


def _export_file(name: str) -> bool:
    """A file name a folder export writes."""
    companions = (CONFIG_FILE, GENERATION_FILE, *TOKENIZER_FILES, *TOKENIZER_EXTRAS)
    mine = (SINGLE_FILE, INDEX_FILE, targets.MARK, *ADAPTER_FILES, *companions)
    return name in mine or bool(_SHARD_RE.fullmatch(name))


def _check_out_folder(out: Path, ckpt: layout.Checkpoint, run: dict, nbytes: int) -> None:
    """A UsageError, before anything is written, when ``out`` is a folder the export must not
    replace: the checkpoint's, the model or tokenizer folder the run read, or one fsdp2lab did
    not write; or when ``nbytes`` of tensors would not fit (leftovers of dead saves removed
    first)."""
    if out.resolve() == ckpt.path.resolve().parent:
        raise UsageError(f"export to {out} refused: it is the checkpoint's folder; give a new one")
    prepare_out(out, run, {ckpt.path.resolve(): "the checkpoint"}, nbytes, "export to")


def prepare_out(out: Path, run: dict, mine: dict[Path, str], nbytes: int, what: str) -> None:
    """Tidy ``out``'s parent (:func:`targets.tidy`), then refuse ``out`` as
    :func:`check_out_folder` does, or when ``nbytes`` of tensors, written twice (the shards, then
    the joined files), would not fit in the free space."""
    targets.tidy(out.absolute().parent)
    check_out_folder(out, run, mine)
    targets.check_space(out, 2 * nbytes, what)


def check_out_folder(out: Path, run: dict, mine: dict[Path, str]) -> None:
    """A UsageError when ``out`` is, or is inside, one of ``mine`` (folder: what it is) or a
    folder the run read (its model, its tokenizer), is not a folder fsdp2lab wrote
    (:func:`targets.check_folder`), or holds other files than an export's."""
    target = out.resolve()
    mine = dict(mine)
    for entry in (run.get("companions") or {}).values():
        if isinstance(entry, dict) and entry.get("folder"):
            mine[Path(str(entry["folder"])).resolve()] = "the folder the run read its files from"
    if run.get("hf_source"):
        mine[Path(str(run["hf_source"])).resolve()] = "the model folder the run started from"
    for folder, what in mine.items():
        if target == folder or folder in target.parents:
            raise UsageError(f"export to {out} refused: it is {what} ({folder}); give a new folder")
    targets.check_folder(out)
    if target.is_dir():
        others = sorted(p.name for p in target.iterdir() if not _export_file(p.name))
        if others:
            raise UsageError(
                f"export to {out} refused: it holds other files than an export's "
                f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); give a new or "
                "empty folder"
            )


def export_safetensors(
    source: str | os.PathLike,
    out: str | os.PathLike,
    hf_config: dict | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
) -> Exported:
    """Write the model of checkpoint ``source`` (a step folder or a checkpoint directory) as
    safetensors: ``out`` ending in ``.safetensors`` is one file; any other ``out`` is a folder
    in the ``save_pretrained`` layout (with ``config.json`` when there is a Hugging Face config:
    ``hf_config``, else the one the checkpoint's run records under ``hf_config``). Floating
    tensors in ``dtype`` (fp32, bf16, fp16), else in the one that config names
    (:func:`save_dtype`; a LoRA run's adapters: as trained, as PEFT keeps them)."""
    ckpt = layout.find_checkpoint(source, [])
    run = saved_run(ckpt)
    recorded = hf_config is None
    if recorded:  # a Hugging Face model's run records its config (checkpoint/state.py)
        hf_config = run.get("hf_config")
    adapters = bool((run.get("config") or {}).get("lora_rank"))
    entries = saved_as(model_entries(ckpt), save_dtype(dtype, None if adapters else hf_config))
    reader = _Reader(ckpt.path)
    out = Path(out)

    def load(entry: Entry) -> torch.Tensor:
        return load_tensor(reader, entry)

    if out.suffix == ".safetensors":
        if not recorded:  # given; the one the run recorded does not ask for a folder
            raise UsageError(
                f"{out}: a Hugging Face export is a folder (config.json and safetensors); "
                "give a folder name, not a .safetensors file"
            )
        total = sum(e.nbytes for e in entries)
        targets.tidy(out.absolute().parent)
        targets.check_space(out, 2 * total, "export to")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = targets.new_folder(out)
        try:
            write_weights(tmp, [entries], load)
            os.replace(tmp / "model-00001-of-00001.safetensors", out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return Exported(ckpt, [out], len(entries), total)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a folder")
    try:
        config, tied = (None, {}) if hf_config is None else _hf_model_info(hf_config, entries)
    except UsageError as e:
        if not recorded:
            raise
        raise UsageError(
            f"{e} (the config the checkpoint's run recorded; for the weights alone, export to "
            "OUT.safetensors)"
        ) from None
    kept = [e for e in entries if e.name not in tied]
    files, total = write_export_folder(out, ckpt, kept, load, config, max_shard_size)
    return Exported(ckpt, files, len(kept), total, tied)


def write_export_folder(
    out: Path,
    ckpt: layout.Checkpoint,
    entries: list[Entry],
    load: Callable[[Entry], torch.Tensor],
    config: object | None,
    max_shard_size: int,
) -> tuple[list[Path], int]:
    """``entries`` (each read by ``load`` in turn) as a ``save_pretrained`` folder ``out``, with
    ``config.json`` and, with a config, the run's recorded companion files; written under a
    temporary name and renamed into place. Returns (files, bytes of tensors)."""
    run = saved_run(ckpt)
    _check_out_folder(out, ckpt, run, sum(e.nbytes for e in entries))
    companions = companion_sources(run) if config is not None else []
    out.parent.mkdir(parents=True, exist_ok=True)
    final, out = out, targets.new_folder(out)
    try:
        shards = plan_shards(entries, max_shard_size)
        files, total = _write_folder(out, shards, load, config)
        for source, name in companions:
            shutil.copyfile(source, out / name)
            files.append(out / name)
        targets.put_in_place(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return [final / p.name for p in files], total


def _write_folder(
    out: Path,
    shards: list[list[Entry]],
    load: Callable[[Entry], torch.Tensor],
    config: object | None,
) -> tuple[list[Path], int]:
    """The weights (one file or shards and their index) and ``config.json`` into ``out``."""
    files = single_file(write_weights(out, shards, load))
    if config is not None:
        layout._write_atomic(out / CONFIG_FILE, config.to_json_string())
        files.append(out / CONFIG_FILE)
    return files, sum(e.nbytes for shard in shards for e in shard)


def single_file(files: list[Path]) -> list[Path]:
    """One output file (and its index) becomes ``model.safetensors`` alone, as
    ``save_pretrained`` names it."""
    if len(files) != 2:
        return files
    shard, index = files
    os.replace(shard, shard.with_name(SINGLE_FILE))
    index.unlink()
    return [shard.with_name(SINGLE_FILE)]


def companion_sources(
    run: dict, changed: Callable[[Path], None] | None = None
) -> list[tuple[Path, str]]:
    """Beside the weights, what ``from_pretrained`` and generation read from a model folder (the
    tokenizer's files, ``generation_config.json``): the files the run recorded
    (``state.companion_files``), each from its recorded folder and checked against its recorded
    sha256 (if it changed: ``changed(file)`` and skipped, without ``changed`` a UsageError). A
    file no longer there is skipped."""
    found = []
    for name, entry in sorted((run.get("companions") or {}).items()):
        if name not in (GENERATION_FILE, *TOKENIZER_FILES, *TOKENIZER_EXTRAS):
            continue  # the mark names only these: anything else is not ours to copy
        if not isinstance(entry, dict) or not entry.get("folder"):
            continue
        file = Path(str(entry["folder"])) / name
        if not file.is_file():
            continue
        if hashlib.sha256(file.read_bytes()).hexdigest() != entry.get("sha256"):
            if changed is not None:
                changed(file)
                continue
            raise UsageError(
                f"{file} changed since the run that saved this checkpoint read it (its sha256 "
                "differs from the one recorded): not copied beside the weights; export to "
                "OUT.safetensors for the weights alone"
            )
        found.append((file, name))
    return found
