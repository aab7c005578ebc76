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

from fsdp2lab.compat import fsdp1
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.parallel import ddp, fsdp2, model_parallel, pp, tp
from fsdp2lab.runtime.mesh import ParallelDims, dp_mesh
from fsdp2lab.training.grad_norm import clip_grad_norm_


@dataclass
class ParallelContext:
    cfg: TrainConfig
    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    units: list[nn.Module]  # the model's layer units
    pipeline: pp.Pipeline | None = None  # set by ``parallelize`` when the model is split (--pp)


def _clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    return clip_grad_norm_(model.parameters(), max_norm, pp_group=pp.stage_group(model))


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
    # The full gradient norm, clipped to ``max_norm`` if given (FSDP1 holds shards of flat grads).
    clip_grad_norm: Callable[[nn.Module, float | None], torch.Tensor] = _clip_grad_norm


def _fsdp2(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """FSDP2 over the data-parallel mesh; with --pp first this rank's stage, with --tp first TP.

    FSDP is applied even where the data-parallel mesh has one rank (e.g. --tp 2 on 2 ranks): it
    then only casts for mixed precision and offloads, and every run keeps the same DTensor layout.
    """
    cfg, dims, units = ctx.cfg, ctx.dims, ctx.units
    tp.check(cfg.model, model, dims.tp)
    if dims.pp > 1:
        model, units = pp.stage_module(cfg.model, model, units, ctx.mesh)
    if dims.tp > 1:
        model = tp.apply_tp(model, cfg.model, ctx.mesh["tp"])
    model = fsdp2.apply_fsdp(
        model,
        dp_mesh(ctx.mesh),
        units,
        precision=cfg.mixed_precision,
        reshard_after_forward=cfg.reshard_value(),
        cpu_offload=cfg.cpu_offload,
        prefetch=cfg.prefetch,
        device=ctx.device,
        unit_policy=cfg.fsdp_units,
        unit_min_params=cfg.fsdp_unit_min_params,
        gloo_collectives=cfg.gloo_collectives,
    )
    if dims.pp > 1:
        n_microbatches = pp.microbatches(cfg.pp_microbatches, dims.pp)
        ctx.pipeline = pp.Pipeline(model, ctx.mesh, ctx.device, n_microbatches, cfg.pp_schedule)
    return model


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
    "ddp": Strategy("ddp", ddp.apply_ddp, ddp.sync_context, autocast=True, materialize_first=True),
    "fsdp1": Strategy(
        "fsdp1",
        fsdp1.apply_fsdp1,
        fsdp1.sync_context,
        materialize_first=True,
        clip_grad_norm=fsdp1.clip_grad_norm,
    ),
    "model-parallel": Strategy(
        "model-parallel",
        model_parallel.apply_model_parallel,
        _no_sync_needed,
        autocast=True,
        max_world_size=1,
        materialize_first=True,
    ),
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


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Checks of --tp, --pp and model-parallel against the model (on the meta device)."""
    from fsdp2lab.data.loader import batch_sizes
    from fsdp2lab.models import get_spec, layer_units
    from fsdp2lab.models.materialize import build_on_meta

    if (cfg.tp > 1 or cfg.pp > 1) and cfg.strategy != "fsdp2":
        message = f"--tp/--pp compose with FSDP2: use --strategy fsdp2, not {cfg.strategy}"
        if cfg.strategy == "model-parallel":
            message += " (it places layers on the devices of one process)"
        raise UsageError(message)
    ddp.check(cfg)
    fsdp1.check(cfg)
    if cfg.tp == 1 and cfg.pp == 1 and cfg.strategy != "model-parallel":
        return
    dims = ParallelDims.resolve(world_size, cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp)
    model = build_on_meta(lambda: get_spec(cfg.model).build(cfg))
    tp.check(cfg.model, model, dims.tp)
    if dims.pp > 1:
        pp.split(cfg.model, model, layer_units(model), dims.pp)
        pp.check(cfg, dims, batch_sizes(cfg, dims.dp)[1])
    if cfg.strategy == "model-parallel":
        pp.pieces_of(cfg.model, model)


def label(cfg: TrainConfig, dims: ParallelDims) -> str:
    """How a run is parallelised, for bench and report: e.g. ``fsdp2``, ``hsdp``, ``fsdp2+tp2``, ``pp2+tp2``."""
    if cfg.strategy != "fsdp2":
        return cfg.strategy
    parts = [f"pp{dims.pp}"] if dims.pp > 1 else []
    if dims.dp > 1 or (dims.tp == 1 and dims.pp == 1):
        parts.append("hsdp" if dims.dp_replicate > 1 else "fsdp2")
    if dims.tp > 1:
        parts.append(f"tp{dims.tp}")
    return "+".join(parts)
