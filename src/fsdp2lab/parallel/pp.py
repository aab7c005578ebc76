"""Pipeline parallelism: the model cut into stages, one per ``pp`` rank, run by a schedule.

A model lists its modules in forward order (``ModelSpec.pipeline``, by name). A split gives every
stage a run of them with an even share of the sharding units; a stage is the model itself with the
other stages' modules removed, which its forward skips (or which the model's
``ModelSpec.pipeline_stage`` hook makes it skip: a Hugging Face model's). So parameter FQNs (and
DCP checkpoints) are the same as unsplit, and no forward is written twice. A parameter that two
stages would share (tied weights) is refused. ``--strategy model-parallel`` places the same runs on
the devices of one process.

Under ``--pp P`` this rank's stage is then tensor-parallelised (``--tp``) and sharded with FSDP2 over
the data-parallel ranks of its stage. :class:`Pipeline` runs it with ``torch.distributed.pipelining``:
a step cuts the rank's batch into micro-batches and runs GPipe (all forwards, then all backwards) or
1F1B (one forward, one backward in steady state) with activations and their gradients sent point to
point between neighbouring stages. Only the last stage computes the loss; it is shared with the
other stages so that every rank reports the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.mesh import ParallelDims
from fsdp2lab.runtime.torch_compat import (
    fix_stage_handshake,
    no_step_outputs,
    pipeline_step,
    stage_shapes_given,
)

log = logs.get_logger(__name__)
_PP_GROUP = "_fsdp2lab_pp_group"  # attribute set on a pipeline stage: its stages' process group


def pipeline_of(spec: ModelSpec, model: nn.Module, what: str) -> list[str]:
    """The model's modules in forward order; every parameter lies in one of them."""
    if spec.pipeline is None:
        raise UsageError(
            f"model {spec.name!r} declares no pipeline (ModelSpec.pipeline), so {what} cannot "
            f"split it into stages"
        )
    names = list(spec.pipeline(model))
    for fqn, _ in model.named_parameters():
        if not any(fqn.startswith(f"{name}.") for name in names):
            raise UsageError(f"{spec.name}: parameter {fqn} is in no module of its pipeline")
    return names


def split(
    spec: ModelSpec, model: nn.Module, units: tuple[str, ...], groups: int, what: str = "--pp"
) -> tuple[tuple[str, ...], ...]:
    """Cut the pipeline's modules into ``groups`` runs, each with an even share of the units.

    Modules that hold no unit (embeddings, the LM head) go with their neighbouring unit: those
    before the first unit to the first group, the others to the group of the unit before them.
    A parameter shared by modules of two groups (a head tied to the embedding) is refused: each
    group would hold a copy, and nothing would sum their gradients.
    """
    names = pipeline_of(spec, model, what)
    is_unit = [any(u == n or u.startswith(f"{n}.") for u in units) for n in names]
    n_units = sum(is_unit)
    if groups > n_units:
        raise UsageError(
            f"{what} {groups} is more than the {n_units} layer units of model {spec.name!r}: "
            f"every stage needs at least one"
        )
    bounds = [g * n_units // groups for g in range(groups + 1)]
    out: list[list[str]] = [[] for _ in range(groups)]
    seen, group = 0, 0
    for name, unit in zip(names, is_unit, strict=True):
        if unit:
            group = max(g for g in range(groups) if bounds[g] <= seen)
            seen += 1
        out[group].append(name)
    groups_out = tuple(tuple(g) for g in out)
    _check_shared(spec, model, groups_out, what)
    return groups_out


def _check_shared(
    spec: ModelSpec, model: nn.Module, groups: tuple[tuple[str, ...], ...], what: str
) -> None:
    """UsageError if one parameter lies in modules of two groups (tied weights)."""
    where: dict[int, tuple[int, str]] = {}  # id(parameter) -> (group, its first name)
    for fqn, param in model.named_parameters(remove_duplicate=False):
        group = next(i for i, g in enumerate(groups) if any(fqn.startswith(f"{n}.") for n in g))
        first = where.setdefault(id(param), (group, fqn))
        if first[0] != group:
            raise UsageError(
                f"{what}: model {spec.name!r} ties {fqn} to {first[1]} (one parameter), which "
                f"would be split between stages {first[0]} and {group} with nothing to sum its "
                "gradients; use a model without tied weights (tie_word_embeddings false)"
            )


def describe(group: tuple[str, ...]) -> str:
    """The modules of a stage, for the log: ``[tok_emb, pos_emb, drop, blocks.0]``."""
    return f"[{', '.join(group)}]"


def remove_modules(model: nn.Module, names: list[str]) -> None:
    """Remove the named modules: deleted from a container (the others keep their names), else set
    to ``None`` (which the model's forward skips)."""
    for name in names:
        parent_name, _, last = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            del parent._modules[last]
        else:
            setattr(parent, last, None)


# ---------------------------------------------------------------------------------------------
def microbatches(pp_microbatches: int | None, pp: int) -> int:
    return pp_microbatches or 2 * pp


def check(cfg: TrainConfig, dims: ParallelDims, micro_batch: int, n: int) -> None:
    """Flag checks for ``--pp`` that need no model (the model's checks are in :func:`split`)."""
    if cfg.pp_schedule == "1f1b" and n < dims.pp:
        raise UsageError(
            f"--pp-schedule 1f1b needs at least as many micro-batches as stages: "
            f"--pp-microbatches {n} < --pp {dims.pp} (or use --pp-schedule gpipe)"
        )
    if micro_batch % n:
        raise UsageError(
            f"the per-rank batch of {micro_batch} samples does not split into --pp-microbatches "
            f"{n} equal micro-batches; choose a --global-batch-size divisible by "
            f"{n} x data-parallel ranks {dims.dp} x grad-accum-steps {cfg.grad_accum_steps}"
        )
    if cfg.mixed_precision == "fp16":
        raise UsageError(
            "--pp with --mixed-precision fp16 is not supported (its loss scaler would skip steps "
            "on some stages only); use bf16"
        )


def make_stage(
    spec: ModelSpec, model: nn.Module, stages: tuple[tuple[str, ...], ...], index: int
) -> nn.Module:
    """Stage ``index`` of ``model``, in place: the other stages' modules removed, then the
    model's ``pipeline_stage`` hook (if any) applied."""
    remove_modules(model, [n for i, g in enumerate(stages) if i != index for n in g])
    if spec.pipeline_stage is not None:
        spec.pipeline_stage(model)
    return model


def stage_module(
    spec: ModelSpec, model: nn.Module, stages: tuple[tuple[str, ...], ...], pp_mesh: DeviceMesh
) -> nn.Module:
    """This rank's stage of ``model`` (on the meta device, not yet parallelised), in place."""
    if dist.get_rank() == 0:
        stages_text = "; ".join(f"stage {i} {describe(g)}" for i, g in enumerate(stages))
        log.info(f"fsdp2lab: pipeline: {stages_text}")
    make_stage(spec, model, stages, pp_mesh.get_local_rank())
    setattr(model, _PP_GROUP, pp_mesh.get_group())
    return model


def stage_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of the pipeline stages, if ``model`` is one stage of a split model."""
    return getattr(model, _PP_GROUP, None)


class Pipeline:
    """Runs this rank's stage: ``train_step`` (forward + backward) and ``forward`` (evaluation).

    PipelineStage infers the shapes sent between stages from the first micro-batch, so a schedule
    is kept per batch shape (training has one; evaluation at most two: full and last batch).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        device: torch.device,
        n_microbatches: int,
        schedule: str,
    ):
        pp_mesh = mesh["pp"]
        self.module = module
        self.group = pp_mesh.get_group()
        self.stage_index = pp_mesh.get_local_rank()
        self.num_stages = pp_mesh.size()
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.num_stages - 1
        self.device = device
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule
        self._loss_fn: Callable | None = None
        self._schedules: dict[tuple, tuple[object, object]] = {}  # (schedule, stage)

    def _schedule(
        self, shape: torch.Size, train: bool, shapes: dict | None = None, n: int | None = None
    ):
        """The schedule for batches of ``shape`` and its stage. ``shapes``: the stage's
        ``input_args``/``output_args``/... given, instead of inferred from its neighbours;
        ``n``: the training schedule's micro-batches, if not ``n_microbatches``."""
        # Imported here, not at the top: it costs every launcher and every rank without --pp
        # most of a second (it brings in torch._dynamo).
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (tuple(shape), train)
        if key not in self._schedules:
            stage = fix_stage_handshake(
                PipelineStage(
                    self.module,
                    self.stage_index,
                    self.num_stages,
                    self.device,
                    group=self.group,
                    **(shapes or {}),
                )
            )
            if train:
                cls = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
                schedule = cls(stage, n or self.n_microbatches, loss_fn=self._loss)
            else:  # forward only: as many equal micro-batches as the batch allows
                schedule = ScheduleGPipe(stage, math.gcd(shape[0], self.n_microbatches))
            self._schedules[key] = (schedule, stage)
        return self._schedules[key]

    def give_shapes(
        self, batch: torch.Size, received: torch.Tensor, sent: torch.Tensor, n: int | None = None
    ):
        """Make the training schedule for batches of ``batch`` (in ``n`` micro-batches, if not
        ``n_microbatches``) with the tensors this stage receives and sends per micro-batch given
        (example tensors of their shapes), so that its first step exchanges no shapes with the
        neighbouring stages (``fsdp2lab plan``); returns its ``PipelineStage``."""
        shapes = stage_shapes_given(received, sent, self.is_first, self.is_last)
        return self._schedule(batch, train=True, shapes=shapes, n=n)[1]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target)

    def _inputs(self, x: torch.Tensor) -> tuple:
        return (x,) if self.is_first else ()

    def train_step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        finalize: bool = True,
    ) -> torch.Tensor:
        """Forward and backward over the micro-batches of ``x``; returns the batch's mean loss on every stage.

        ``loss_fn`` is a mean over its micro-batch; the schedule divides gradients by the number
        of micro-batches, so they are those of the mean over the batch. ``finalize=False`` leaves
        FSDP's gradient reduction (and that division) for a later step (gradient accumulation;
        :func:`fsdp2lab.runtime.torch_compat.pipeline_step`).
        """
        self._loss_fn = loss_fn
        schedule, stage = self._schedule(x.shape, train=True)
        losses: list[torch.Tensor] = []
        target = y if self.is_last else None
        pipeline_step(
            schedule,
            stage,
            *self._inputs(x),
            target=target,
            losses=losses,
            finalize=finalize,
            **no_step_outputs(schedule),
        )
        loss = (
            torch.stack([t.detach().float() for t in losses]).mean()
            if self.is_last
            else torch.zeros((), device=self.device)
        )
        dist.all_reduce(loss, group=self.group)  # only the last stage's is non-zero
        return loss

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The model's output for ``x`` on the last stage; ``None`` on the others."""
        schedule, _ = self._schedule(x.shape, train=False)
        # A new schedule's first step infers shapes with a real forward and then drops the
        # stage's gradients: evaluation keeps them (they are part of the training state).
        grads = [(p, p.grad) for p in self.module.parameters()]
        out = schedule.step(*self._inputs(x))
        for p, grad in grads:
            p.grad = grad
        return out

    def from_last_stage(self, values: list[float]) -> list[float]:
        """The last stage's ``values`` on every stage (the others pass zeros)."""
        mine = values if self.is_last else [0.0] * len(values)
        t = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()
