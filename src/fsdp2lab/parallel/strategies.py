"""``--strategy NAME`` -> how the model is parallelised and how gradient sync is switched off.

Every strategy shares the model, data, optimizer, training loop and checkpoint code; only the
entry here differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.parallel import fsdp2
from fsdp2lab.runtime.mesh import ParallelDims, dp_mesh


@dataclass
class ParallelContext:
    cfg: TrainConfig
    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    units: list[nn.Module]  # the model's layer units


@dataclass(frozen=True)
class Strategy:
    name: str
    parallelize: Callable[[nn.Module, ParallelContext], nn.Module]
    # How gradient sync is turned off for accumulation micro-steps: a context per micro-step.
    sync_context: Callable[[nn.Module, bool], contextlib.AbstractContextManager]
    # Mixed precision by torch.autocast (strategies that do not cast parameters themselves).
    autocast: bool = False
    max_world_size: int | None = None
    # Wrappers that need real weights to wrap (FSDP1's flat parameters, DDP's broadcast) get the
    # model materialised and initialised before ``parallelize``; the others after it (meta init).
    materialize_first: bool = False


def _fsdp2(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    cfg = ctx.cfg
    return fsdp2.apply_fsdp(
        model,
        dp_mesh(ctx.mesh),
        ctx.units,
        precision=cfg.mixed_precision,
        reshard_after_forward=cfg.reshard_value(),
        cpu_offload=cfg.cpu_offload,
        prefetch=cfg.prefetch,
        device=ctx.device,
    )


def _fsdp2_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    fsdp2.set_gradient_sync(model, sync)
    return contextlib.nullcontext()


def _single(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    return model


def _no_sync_needed(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


STRATEGIES: dict[str, Strategy] = {
    "fsdp2": Strategy("fsdp2", _fsdp2, _fsdp2_sync),
    "single": Strategy("single", _single, _no_sync_needed, autocast=True, max_world_size=1),
}


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise UsageError(
            f"strategy {name!r} is not available; choose one of: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]


def check_world_size(strategy: Strategy, world_size: int) -> None:
    if strategy.max_world_size is not None and world_size > strategy.max_world_size:
        raise UsageError(
            f"--strategy {strategy.name} runs in one process, but {world_size} ranks were started "
            f"(use --nproc-per-node 1, or another strategy)"
        )
