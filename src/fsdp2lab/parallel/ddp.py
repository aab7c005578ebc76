"""DDP: every data-parallel rank holds the whole model; gradients are all-reduced in buckets.

The weights must exist before wrapping (``materialize_first``): DDP broadcasts rank 0's
parameters and registers its gradient hooks on real tensors. Mixed precision is ``torch.autocast``
(the trainer's), as for ``single``.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from fsdp2lab.errors import UsageError


def check(cfg) -> None:
    """Flags DDP cannot honour (a UsageError before any worker starts)."""
    if cfg.cpu_offload:
        raise UsageError("--cpu-offload offloads sharded state: use --strategy fsdp1 or fsdp2")


def apply_ddp(model: nn.Module, plan, mesh, device) -> nn.Module:
    """Wrap ``model`` (materialised) in DDP over all ranks (every rank is a data-parallel rank)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """``no_sync`` for accumulation micro-steps: gradients stay local until the last one."""
    return contextlib.nullcontext() if sync else model.no_sync()
