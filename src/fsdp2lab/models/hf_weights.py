"""A Hugging Face folder's safetensors weights read into a (sharded) model, each rank its own slices.

:class:`WeightIndex` reads only the files' headers: which file holds each tensor, its shape and
dtype. ``check`` compares them with the model built from the config before any worker starts;
``load`` copies each tensor's part that this rank holds (a DTensor's local shard: FSDP2, HSDP,
TP, or a pipeline stage's tensors) into it, converting the file's dtype (bf16, fp16) to the
parameter's (fp32 master weights), or quantizing it into an NF4 shard (``--quantize-base``), so
no rank ever holds the whole model. Tied parameters (an embedding shared with the output head)
are read once, under whichever of their names the files hold. Non-persistent buffers (a rotary
embedding's ``inv_freq``) are not in any checkpoint: they keep the values the model computed when
it was built.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2lab.errors import UsageError
from fsdp2lab.models.materialize import _lookup
from fsdp2lab.models.nf4 import is_nf4, quantize_into
from fsdp2lab.runtime.torch_compat import (
    SafeLoadPlanner,
    hf_storage_reader,
    local_shape_and_offset,
    local_tensor,
)

INDEX = "model.safetensors.index.json"


def base_key(name: str) -> str:
    """A parameter's name in the files: a PEFT LoRA layer keeps the frozen linear it adapts as
    ``base_layer`` (``...q_proj.base_layer.weight`` is the files' ``...q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def _tensor_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each persistent tensor with its names (several for tied parameters), in model order."""
    persistent = set(model.state_dict(keep_vars=True))
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_id.values())


@dataclass(frozen=True)
class WeightIndex:
    folder: Path
    files: dict[str, str]  # tensor name -> file name in ``folder``
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @classmethod
    def read(cls, folder: Path) -> WeightIndex | None:
        """The index of the folder's safetensors files (headers only); None when it has none.
        A malformed index, a file it names outside the folder or missing, a file whose header
        safetensors refuses (damaged, truncated): UsageError naming the file."""
        from safetensors import SafetensorError, safe_open

        index = folder / INDEX
        names = _indexed_files(index) if index.is_file() else None
        if names is None:
            names = sorted(p.name for p in folder.glob("*.safetensors"))
        if not names:
            return None
        files, shapes, dtypes = {}, {}, {}
        for name in names:
            if not (folder / name).is_file():
                raise UsageError(f"--model hf:{folder}: {INDEX} names {name}, which is missing")
            try:
                with safe_open(folder / name, framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        part = f.get_slice(key)
                        files[key] = name
                        shapes[key] = tuple(part.get_shape())
                        dtypes[key] = part.get_dtype()
            except (SafetensorError, OSError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UsageError(
                    f"--model hf:{folder}: {name} is not a readable safetensors file ({first})"
                ) from None
        return cls(folder, files, shapes, dtypes)

    def _keys(self, model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor, str | None]]:
        """Each tensor of ``model``, its names, and the name the files hold it under (None:
        absent)."""
        for names, tensor in _tensor_groups(model):
            keys = (base_key(n) for n in names)  # a LoRA-adapted linear's frozen weight
            yield names, tensor, next((k for k in keys if k in self.files), None)

    def check(self, model: nn.Module, reference: str) -> None:
        """UsageError unless every tensor of ``model`` is in the files with its shape, and every
        tensor of the files is one of the model's (keys that map one to one)."""
        where = f"--model {reference}"
        known = {n for names, _ in _tensor_groups(model) for n in names}
        unexpected = sorted(k for k in self.files if k not in known and not _is_buffer(model, k))
        if unexpected:
            raise UsageError(
                f"{where}: the checkpoint's tensors do not map one to one onto the modules of "
                f"{type(model).__name__} (e.g. {unexpected[0]}); an architecture that needs "
                "transformers' key conversion is not supported"
            )
        for names, tensor, key in self._keys(model):
            if key is None:
                raise UsageError(f"{where}: the checkpoint has no tensor {names[0]}")
            want = tuple(tensor.shape)
            if self.shapes[key] != want:
                raise UsageError(
                    f"{where}: tensor {key} has shape {list(self.shapes[key])} in "
                    f"{self.files[key]}, but the config gives {list(want)}"
                )

    def load(self, model: nn.Module, reference: nn.Module) -> None:
        """Read the weights into ``model`` (parallelised and materialised); ``reference`` is the
        unparallelised meta model it was copied from (its real non-persistent buffers). Through
        DCP's HuggingFaceStorageReader where it reads slices, else (and NF4 weights, quantized as
        they are read) safetensors' ``get_slice``."""
        targets = self.targets(model, reference)
        reader = hf_storage_reader()
        with torch.no_grad():
            nf4 = {key: t for key, t in targets.items() if is_nf4(t)}  # quantized as read
            self.read_slices(nf4)
            rest = {key: t for key, t in targets.items() if key not in nf4}
            if reader is not None:
                self.read_with_dcp(rest, reader)
            else:
                self.read_slices(rest)
            persistent = set(reference.state_dict(keep_vars=True))
            for name, buffer in reference.named_buffers():
                target = _lookup(model, name)
                if name not in persistent and target is not None:
                    target.copy_(buffer)

    def targets(self, model: nn.Module, reference: nn.Module) -> dict[str, torch.Tensor]:
        """{name in the files: the tensor of ``model`` it goes into}, for the tensors ``model``
        holds (a pipeline stage holds some)."""
        out = {}
        for names, _, key in self._keys(reference):
            if key is None:  # LoRA adapters: not in the base's files
                continue
            target = next((t for t in (_lookup(model, n) for n in names) if t is not None), None)
            if target is not None:
                out[key] = target
        return out

    def read_slices(self, targets: dict[str, torch.Tensor]) -> None:
        """Each target's part, read with safetensors' ``safe_open(...).get_slice``."""
        from safetensors import safe_open

        with ExitStack() as stack:
            opened: dict[str, object] = {}
            for key, target in targets.items():
                name = self.files[key]
                if name not in opened:
                    opened[name] = stack.enter_context(
                        safe_open(self.folder / name, framework="pt")
                    )
                _read_into(target, opened[name], key)

    def read_with_dcp(self, targets: dict[str, torch.Tensor], reader: type) -> None:
        """Each target's part, read by DCP (it plans each rank's slices of each file; a tensor
        of another dtype is converted as it is copied in)."""
        import torch.distributed.checkpoint as dcp

        dcp.load(dict(targets), storage_reader=reader(str(self.folder)), planner=SafeLoadPlanner())


def _indexed_files(index: Path) -> list[str]:
    """The file names of an index's ``weight_map``, each a file inside its folder."""
    where = f"--model hf:{index.parent}: {INDEX}"
    try:
        raw = json.loads(index.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{where} is not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"{where} has no weight_map (an object of tensor name: file name)")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"{where}: weight_map[{key!r}] is {name!r}, not a file name")
        # Checked on the name, not the resolved path: a hub cache's files are links to its blobs.
        if PurePath(name).is_absolute() or ".." in PurePath(name).parts:
            raise UsageError(
                f"{where}: weight_map[{key!r}] names {name}, outside the model's folder"
            )
    return sorted(set(weight_map.values()))


def _read_into(target: torch.Tensor, file, key: str) -> None:
    """Copy the part of tensor ``key`` that ``target`` holds (a DTensor's local shard) into it
    (an NF4 shard: quantized, ``nf4.quantize_into``)."""
    if target.dim() == 0:
        target.copy_(file.get_tensor(key))
        return
    local = target
    if isinstance(target, DTensor):
        shape, offset = local_shape_and_offset(target)
        local = local_tensor(target)
    else:
        shape, offset = tuple(target.shape), (0,) * target.dim()
    if 0 in shape:
        return
    part = file.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    if is_nf4(local):
        quantize_into(target, part)
    else:
        local.copy_(part)


def _is_buffer(model: nn.Module, name: str) -> bool:
    """A (non-persistent) buffer of the model that an older checkpoint may hold (``inv_freq``)."""
    try:
        model.get_buffer(name)
    except AttributeError:
        return False
    return True
