"""``--strategy model-parallel``: the model's layers on different devices of one process.

The simplest model parallelism (the seed's: ``net1`` on one GPU, ``net2`` on the next): the model's
pipeline modules are cut into runs as for ``--pp``, each run lives on its own device, and each
module's input is moved to its device when it runs (autograd copies gradients back). Only one device
computes at a time; there is no micro-batching (that is what ``--pp`` adds).

Devices: ``cuda:0..N-1`` with N GPUs (one run per GPU, at most one per unit); on CPU two runs, both
on ``cpu``, which goes through the same code. One process, so ``--nproc-per-node 1``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp2lab.parallel.pp import describe
from fsdp2lab.runtime import logs

log = logs.get_logger(__name__)


def group_count(device_preference: str, n_units: int) -> int:
    """How many devices the model is spread over: every GPU (at most one per unit), or 2 on CPU."""
    if device_preference != "cpu" and torch.cuda.is_available():
        return max(1, min(torch.cuda.device_count(), n_units))
    return min(2, n_units)


def _to(device: torch.device):
    def move(module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

    return move


def apply_model_parallel(model: nn.Module, plan, mesh, device: torch.device) -> nn.Module:
    """Place the (materialised) model's runs of modules on their devices; output on ``device``."""
    where = []
    for i, group in enumerate(plan.stages):
        target = torch.device("cuda", i) if device.type == "cuda" else device
        for name in group:
            module = model.get_submodule(name)
            module.to(target)
            module.register_forward_pre_hook(_to(target))
        where.append(f"{describe(group)} on {target}")
    log.info(f"fsdp2lab: model-parallel: {'; '.join(where)}")
    model.register_forward_hook(lambda module, args, out: out.to(device))
    return model
