"""FSDP2: ``fully_shard`` each layer unit, then the root, over the data-parallel mesh.

On a 1D mesh (``dp_shard``) this is plain FSDP; on a 2D mesh (``dp_replicate``, ``dp_shard``) it
is HSDP: parameters are sharded within a replica group and replicated across groups.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Compute in ``precision``; reduce gradients in fp32; sharded parameters stay fp32."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    units: list[nn.Module],
    *,
    precision: str = "fp32",
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    prefetch: int = 0,
    device: torch.device | None = None,
) -> nn.Module:
    """Shard each unit, then the root (which takes the parameters no unit holds).

    ``prefetch`` > 0 sets explicit prefetching: each unit's forward all-gathers the next
    ``prefetch`` units, and its backward the previous ones.
    """
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=mixed_precision_policy(precision),
        offload_policy=offload_policy(cpu_offload, device or torch.device("cpu")),
    )
    for i, unit in enumerate(units):
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        last = i == len(units) - 1
        fully_shard(unit, reshard_after_forward=False if last else reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    if prefetch > 0:
        set_prefetch(units, prefetch)
    return model


def set_prefetch(units: list[nn.Module], depth: int) -> None:
    """Explicit prefetch of ``depth`` units ahead in forward and behind in backward."""
    sharded = [u for u in units if isinstance(u, FSDPModule)]
    for i, unit in enumerate(sharded):
        ahead = sharded[i + 1 : i + 1 + depth]
        behind = sharded[max(0, i - depth) : i][::-1]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn off reduce-scatter for gradient-accumulation micro-steps (on for the last one)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
