"""``--strategy NAME`` -> how the model is parallelised and how gradient sync is switched off.

Every strategy shares the model, data, optimizer, training loop and checkpoint code; only the
entry here differs. ``parallelize(model, plan, mesh, device)`` is the one call the trainer makes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models.materialize import init_weights, to_empty
from fsdp2lab.models.spec import ModelSpec
from fsdp2lab.parallel import ddp, fsdp1, fsdp2, model_parallel, pp, tp
from fsdp2lab.parallel.activation_checkpoint import apply_activation_checkpointing
from fsdp2lab.parallel.compile import compile_units
from fsdp2lab.parallel.grad_norm import clip_grad_norm_
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.mesh import ParallelDims, dp_mesh

log = logs.get_logger(__name__)


class RunPlan(Protocol):
    """What parallelising reads of the run plan (``fsdp2lab.plan.RunPlan``)."""

    cfg: TrainConfig
    dims: ParallelDims
    spec: ModelSpec
    strategy: Strategy
    units: tuple[str, ...]  # the sharding (and AC, compile) units, by module name
    head: tuple[str, ...]  # the output head's modules, by name
    stages: tuple[tuple[str, ...], ...]  # module names per pipeline stage or device
    meta_model: nn.Module


def _clip_grad_norm(
    model: nn.Module, max_norm: float | None, flag: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return clip_grad_norm_(model.parameters(), max_norm, pp.stage_group(model), flag)


def _no_check(cfg) -> None:
    pass


@dataclass(frozen=True)
class Strategy:
    name: str
    # (meta or materialised model, plan, mesh, device) -> the parallelised model.
    parallelize: Callable[[nn.Module, RunPlan, DeviceMesh, torch.device], nn.Module]
    # How gradient sync is turned off for accumulation micro-steps: a context per micro-step.
    sync_context: Callable[[nn.Module, bool], contextlib.AbstractContextManager]
    # Flags this strategy cannot honour: a UsageError before any worker starts.
    check: Callable[[object], None] = _no_check
    # Mixed precision by torch.autocast (strategies that do not cast parameters themselves).
    autocast: bool = False
    max_world_size: int | None = None
    # Wrappers that need real weights to wrap (FSDP1's flat parameters, DDP's broadcast) get the
    # model materialised and initialised before ``parallelize``; the others after it (meta init).
    materialize_first: bool = False
    # The full gradient norm, clipped to ``max_norm`` if given (FSDP1 holds shards of flat grads).
    # (model, max_norm, flag) -> (the full gradient norm, whether the flag is non-finite on some
    # rank where that rode on the norm's all-reduce, else None)
    clip_grad_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = _clip_grad_norm


def _fsdp2(model: nn.Module, plan: RunPlan, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """This rank's pipeline stage (--pp), then TP (--tp), then FSDP2 over the data-parallel mesh.

    FSDP is applied even where the data-parallel mesh has one rank (e.g. --tp 2 on 2 ranks): it
    then only casts for mixed precision and offloads, and every run keeps the same DTensor layout.
    """
    cfg = plan.cfg
    if plan.dims.pp > 1:
        model = pp.stage_module(plan.spec, model, plan.stages, mesh["pp"])
    if plan.dims.tp > 1:
        model = tp.apply_tp(model, plan.spec, mesh["tp"])
        if plan.spec.tp_plan_name:
            log.info(f"fsdp2lab: tensor parallel plan: {plan.spec.tp_plan_name}")
    _checkpoint_and_compile(model, plan, device)
    return fsdp2.apply_fsdp(
        model,
        dp_mesh(mesh),
        [module for _, module in held_units(model, plan.units)],
        head=[module for _, module in held_units(model, plan.head)],
        precision=cfg.mixed_precision,
        reshard_after_forward=cfg.reshard_value(),
        cpu_offload=cfg.cpu_offload,
        prefetch=cfg.prefetch,
        device=device,
        unit_policy=cfg.fsdp_units,
        unit_min_params=cfg.fsdp_unit_min_params,
        reduce_every_micro_batch=fsdp2.reduces_every_micro_batch(
            cfg.grad_accum_reduce, plan.dims.dp_shard
        ),
        reduce_by_all_to_all=plan.device_type == "cpu",  # gloo's reduce-scatter all-reduces
        unsharded={model.get_parameter(name) for name in plan.unsharded} or None,
    )


def _checkpoint_and_compile(model: nn.Module, plan: RunPlan, device: torch.device) -> None:
    """Activation checkpointing, then ``torch.compile``, of each unit (after TP, before wrapping)."""
    units = [name for name, _ in held_units(model, plan.units)]
    apply_activation_checkpointing(model, units, plan.cfg.activation_checkpointing)
    if plan.cfg.compile:
        compile_units(model, units, device_type=device.type)


def _units_first(wrap: Callable) -> Callable:
    """A strategy that checkpoints and compiles the units, then calls ``wrap``."""

    def parallelize(model: nn.Module, plan: RunPlan, mesh: DeviceMesh, device: torch.device):
        _checkpoint_and_compile(model, plan, device)
        return wrap(model, plan, mesh, device)

    return parallelize


def held_units(model: nn.Module, units: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The units ``model`` holds (a pipeline stage holds some): (name, module)."""
    held = []
    for name in units:
        with contextlib.suppress(AttributeError):
            held.append((name, model.get_submodule(name)))
    return held


def _fsdp2_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    fsdp2.set_gradient_sync(model, sync)
    return contextlib.nullcontext()


def _single(model: nn.Module, plan: RunPlan, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    return model


def _no_sync_needed(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


STRATEGIES: dict[str, Strategy] = {
    "fsdp2": Strategy("fsdp2", _fsdp2, _fsdp2_sync),
    "single": Strategy(
        "single", _units_first(_single), _no_sync_needed, autocast=True, max_world_size=1
    ),
    "ddp": Strategy(
        "ddp",
        _units_first(ddp.apply_ddp),
        ddp.sync_context,
        check=ddp.check,
        autocast=True,
        materialize_first=True,
    ),
    "fsdp1": Strategy(
        "fsdp1",
        fsdp1.apply_fsdp1,
        fsdp1.sync_context,
        check=fsdp1.check,
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


def build_model(plan: RunPlan, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """A copy of the plan's meta model, parallelised by its strategy, materialised on ``device``
    (CPU with --cpu-offload) and initialised the same way for every layout."""
    reference = plan.meta_model
    model = copy.deepcopy(reference)
    init_device = "cpu" if plan.cfg.cpu_offload else device
    if plan.strategy.materialize_first:
        to_empty(model, init_device)
        _initialise(model, plan)
        return plan.strategy.parallelize(model, plan, mesh, device)
    model = plan.strategy.parallelize(model, plan, mesh, device)
    to_empty(model, init_device)
    _initialise(model, plan)
    return model


def _initialise(model: nn.Module, plan: RunPlan) -> None:
    """The model's pretrained weights where it has them (each rank reads its own part), else the
    seeded init."""
    if plan.spec.load_weights is not None:
        plan.spec.load_weights(model, plan.meta_model)
    else:
        init_weights(model, plan.meta_model, plan.cfg.seed)


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise UsageError(
            f"strategy {name!r} is not available; choose one of: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]


def label(cfg, dims) -> str:
    """How a run is parallelised, for bench and report: e.g. ``fsdp2``, ``hsdp``, ``fsdp2+tp2``, ``pp2+tp2``."""
    if cfg.strategy != "fsdp2":
        return cfg.strategy
    parts = [f"pp{dims.pp}"] if dims.pp > 1 else []
    if dims.dp > 1 or (dims.tp == 1 and dims.pp == 1):
        parts.append("hsdp" if dims.dp_replicate > 1 else "fsdp2")
    if dims.tp > 1:
        parts.append(f"tp{dims.tp}")
    return "+".join(parts)
