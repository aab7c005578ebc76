"""Plain ``torch.save`` state dicts of the unwrapped model (for inference, like the seeds' mnist_cnn.pt)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2lab.runtime.distributed import Runtime


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict on CPU; a collective: call it on every rank."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """Write to a temporary file in the same folder, then rename: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_full_model(model: nn.Module, path: str, runtime: Runtime) -> None:
    state = full_state_dict(model)
    if runtime.is_main:
        atomic_torch_save(state, path)
