"""Legacy FSDP1 (``FullyShardedDataParallel``), configured from the same flags as FSDP2.

=============================  =====================================================
FSDP2 flag                     FSDP1 setting
=============================  =====================================================
layer units (``fully_shard``)  ``auto_wrap_policy``: one FSDP unit per layer unit,
                               or by size with ``--fsdp1-min-params``
reshard-after-forward true     ``ShardingStrategy.FULL_SHARD``
reshard-after-forward false    ``ShardingStrategy.SHARD_GRAD_OP``
``--dp-replicate`` > 1         ``HYBRID_SHARD`` (``_HYBRID_SHARD_ZERO2`` if false)
``--mixed-precision``          ``MixedPrecision(param_dtype, reduce_dtype=fp32)``
``--cpu-offload``              ``CPUOffload(offload_params=True)``
``--prefetch N`` (N > 0)       ``forward_prefetch=True``; backward: ``BACKWARD_PRE``
=============================  =====================================================

Always ``use_orig_params=True``, so the optimizer, gradient clipping and
``torch.distributed.checkpoint.state_dict`` see the original parameter names: a DCP checkpoint
written here loads under FSDP2, DDP or a single process, and the reverse.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, size_based_auto_wrap_policy

from fsdp2lab.errors import UsageError
from fsdp2lab.parallel.precision import DTYPES
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.mesh import dp_mesh

log = logs.get_logger(__name__)


DEPRECATION_NOTE = (
    "fsdp2lab: note: --strategy fsdp1 runs the legacy FullyShardedDataParallel, which PyTorch "
    "is retiring in favour of fully_shard (FSDP2); it is here to compare with and migrate from "
    "(docs/fsdp1-vs-fsdp2.md), so its deprecation warnings are expected and not repeated."
)
# Warnings FSDP1 gives for the settings above; each is explained by DEPRECATION_NOTE.
_EXPECTED_WARNINGS = (
    r".*(deprecat|FSDP is switching to use `NO_SHARD`)",
    r".*(FullyShardedDataParallel|FSDP\.state_dict_type)",
)


def check(cfg) -> None:
    """Flags FSDP1 cannot honour (a UsageError before any worker starts)."""
    reshard = cfg.reshard_value()
    if not isinstance(reshard, bool):
        raise UsageError(
            f"--strategy fsdp1 has no equivalent of --reshard-after-forward {reshard} "
            "(resharding to a smaller group is FSDP2 only); use true or false"
        )
    if cfg.mixed_precision == "fp16":
        # FSDP1's shards are plain tensors: each rank's scaler would see only its own shard's
        # overflow, and the ranks would skip different steps.
        raise UsageError(
            "--mixed-precision fp16 with --strategy fsdp1: the gradient scaler cannot agree "
            "across FSDP1's shards; use --strategy fsdp2 (its scaler checks every shard) or bf16"
        )


def sharding_strategy(reshard_after_forward: bool, hybrid: bool) -> ShardingStrategy:
    """FSDP2's reshard setting and mesh -> FSDP1's sharding strategy."""
    if hybrid:
        return (
            ShardingStrategy.HYBRID_SHARD
            if reshard_after_forward
            else ShardingStrategy._HYBRID_SHARD_ZERO2
        )
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def wrap_policy(units: list[nn.Module], min_params: int | None):
    """One FSDP1 unit per layer unit (the units FSDP2 shards), or size-based."""
    if min_params is not None:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)
    unit_ids = {id(u) for u in units}
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)


def mixed_precision(precision: str) -> MixedPrecision | None:
    """As FSDP2's policy: compute in ``precision``, reduce gradients in fp32, keep fp32 shards."""
    if precision == "fp32":
        return None
    return MixedPrecision(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def apply_fsdp1(model: nn.Module, plan, mesh, device) -> nn.Module:
    """Wrap the materialised ``model`` in FSDP1 over the data-parallel mesh."""
    cfg = plan.cfg
    hybrid = plan.dims.dp_replicate > 1
    strategy = sharding_strategy(cfg.reshard_value(), hybrid)
    if plan.dims.dp == 1:
        strategy = ShardingStrategy.NO_SHARD  # what FSDP1 switches to itself, with a warning
    if dist.get_rank() == 0:
        log.info(DEPRECATION_NOTE)
    for pattern in _EXPECTED_WARNINGS:  # for the rest of this process: training and checkpoints
        warnings.filterwarnings("ignore", message=pattern)
    return FSDP(
        model,
        device_mesh=dp_mesh(mesh),
        sharding_strategy=strategy,
        auto_wrap_policy=wrap_policy(
            [model.get_submodule(u) for u in plan.units], cfg.fsdp1_min_params
        ),
        mixed_precision=mixed_precision(cfg.mixed_precision),
        cpu_offload=CPUOffload(offload_params=cfg.cpu_offload),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=cfg.prefetch > 0,
        device_id=device,
        use_orig_params=True,
    )


def sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """``no_sync`` for accumulation micro-steps (unsharded gradients accumulate locally)."""
    return contextlib.nullcontext() if sync else model.no_sync()


def clip_grad_norm(
    model: nn.Module, max_norm: float | None, flag: torch.Tensor | None = None
) -> tuple[torch.Tensor, None]:
    """The full gradient norm (each rank holds shards of flat gradients); clip if ``max_norm``.
    ``flag`` does not ride on FSDP1's own reduction."""
    return model.clip_grad_norm_(math.inf if max_norm is None else max_norm), None
