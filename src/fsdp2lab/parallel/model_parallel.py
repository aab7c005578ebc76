"""``--strategy model-parallel``: the model's layers on different devices of one process.

The simplest model parallelism (the seed's: ``net1`` on one GPU, ``net2`` on the next): the layer
units are cut into groups as for ``--pp`` (the same pieces), each group lives on its own device, and
the activation is copied from device to device during forward (autograd copies its gradient back).
Only one device computes at a time; there is no micro-batching (that is what ``--pp`` adds).

Devices: ``cuda:0..N-1`` with N GPUs (one group per GPU, at most one per layer unit); on CPU two
groups, both on ``cpu``, which runs the same code path. One process, so ``--nproc-per-node 1``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp2lab.parallel.pp import PiecewiseModule, describe, split
from fsdp2lab.runtime import logs

log = logs.get_logger(__name__)


def group_devices(device: torch.device, n_units: int) -> list[torch.device]:
    """One device per layer group: every GPU (at most one per unit), or two groups on CPU."""
    if device.type == "cuda":
        n = max(1, min(torch.cuda.device_count(), n_units))
        return [torch.device("cuda", i) for i in range(n)]
    return [device] * min(2, n_units)


def apply_model_parallel(model: nn.Module, ctx) -> nn.Module:
    """Place the (materialised) model's layer groups on their devices; output on ``ctx.device``."""
    devices = group_devices(ctx.device, len(ctx.units))
    groups = split(ctx.cfg.model, model, ctx.units, len(devices), "--strategy model-parallel")
    pieces, piece_devices, where = [], [], []
    for group, device in zip(groups, devices, strict=True):
        for piece in group:
            for name in piece.modules:
                model.get_submodule(name).to(device)
        pieces += group
        piece_devices += [device] * len(group)
        where.append(f"{describe(group)} on {device}")
    log.info(f"fsdp2lab: model-parallel: {'; '.join(where)}")
    return PiecewiseModule(model, pieces, piece_devices, output_device=ctx.device)
