"""Plain ``torch.save`` state dicts of the unwrapped model (for inference, like the seeds'
mnist_cnn.pt), and conversion between them and DCP checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2lab.checkpoint import layout
from fsdp2lab.checkpoint.state import MODEL, RUN
from fsdp2lab.errors import UsageError
from fsdp2lab.parallel.pp import stage_group
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.runtime.torch_compat import SafeFileSystemReader, SafeLoadPlanner


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict on CPU; a collective: call it on every rank.

    Under pipeline parallelism each stage holds only its own layers: the stages' parts are joined.
    """
    group = stage_group(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=group is None)
    state = get_model_state_dict(model, options=options)
    if group is not None:
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=group)
        state = {k: v for part in parts for k, v in part.items()}
    return state


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """Write to a temporary file in the same folder, then rename: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.temporary_name(path)
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_full_model(model: nn.Module, path: str, runtime: Runtime) -> None:
    state = full_state_dict(model)
    if runtime.is_main:
        atomic_torch_save(state, path)


@contextlib.contextmanager
def _one_process():
    """DCP in one process without a process group (it warns that it assumes so: that is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


def read_model_weights(ckpt: layout.Checkpoint) -> dict[str, torch.Tensor]:
    """The full model tensors of a checkpoint, in one process (DCP assembles the shards)."""
    prefix = MODEL + "."
    template = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in ckpt.metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    if not template:
        raise UsageError(f"checkpoint {ckpt.path} holds no model tensors")
    try:
        with _one_process():
            dcp.load(
                template,
                storage_reader=SafeFileSystemReader(ckpt.path),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except (Exception, CheckpointException) as e:
        why = layout.read_error(e)
        raise UsageError(f"checkpoint {ckpt.path} could not be read: {why}") from None
    return {key[len(prefix) :]: value for key, value in template.items()}


def export_checkpoint(source: str, out: str) -> tuple[layout.Checkpoint, dict]:
    """Write the model of checkpoint ``source`` (a step folder or a checkpoint directory) as a
    plain state dict that ``model.load_state_dict`` takes."""
    ckpt = layout.find_checkpoint(source, [])
    weights = read_model_weights(ckpt)
    atomic_torch_save(weights, out)
    return ckpt, weights


def import_state_dict(source: str, root: str) -> Path:
    """Make ``root/step-0``, a DCP checkpoint of the weights in ``source`` (``torch.save``-d),
    to fine-tune from with ``--ckpt-dir root``. Never writes into a directory with checkpoints."""
    src = Path(source)
    if not src.is_file():
        raise UsageError(f"state dict not found: {source}")
    try:
        weights = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:
        why = layout.read_error(e)
        raise UsageError(f"{source} cannot be read as a torch.save file ({why})") from None
    if not (
        isinstance(weights, dict)
        and weights
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())
    ):
        raise UsageError(f"{source} is not a state dict (a dict of names to tensors)")
    root_path = Path(root)
    if layout.step_folders(root_path):
        raise UsageError(f"{root} already holds checkpoints; import into a new directory")
    path = layout.step_dir(root_path, 0)
    layout.mark_own(path)
    run = {"source": str(src.resolve()), "imported": True}
    with _one_process():
        dcp.save({MODEL: dict(weights), RUN: json.dumps(run)}, checkpoint_id=path, no_dist=True)
    info = {"step": 0, "epoch": 1, "samples_seen": 0, "epoch_samples": 0, "contents": [MODEL, RUN]}
    layout.mark_complete(path, {**info, **run})
    layout.set_latest(root_path, path)
    return path
