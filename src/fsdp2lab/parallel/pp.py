"""Pipeline parallelism: the model cut into stages, one per ``pp`` rank, run by a schedule.

Each model is written down once more as an ordered list of *pieces* (``PIECES``): the modules a
piece runs and the function that runs them, so that running the pieces in order is the model's
forward (``tests/test_pp.py`` checks this for every model). A split gives every stage a run of
pieces with an even share of the layer units; a stage is a :class:`PiecewiseModule` that holds its
modules under the model's own names, so parameter FQNs (and DCP checkpoints) are the same as
unsplit. ``--strategy model-parallel`` reuses the same pieces, placing them on devices in one
process.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.mesh import ParallelDims
from fsdp2lab.runtime.torch_compat import fix_stage_handshake, pipeline_step

log = logs.get_logger(__name__)


@dataclass(frozen=True)
class Piece:
    """A contiguous part of a model's forward: ``run(root, x)`` uses only ``root``'s ``modules``."""

    modules: tuple[str, ...]
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _seq(*names: str) -> Piece:
    """A piece that applies the named modules one after the other."""

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for name in names:
            x = m.get_submodule(name)(x)
        return x

    return Piece(names, run)


def _mlp(model: nn.Module) -> list[Piece]:
    return [_seq("flatten", "fc.0", "fc.1"), _seq("fc.2", "fc.3"), _seq("fc.4")]


def _mlp2(model: nn.Module) -> list[Piece]:
    return [
        Piece(("net1", "relu"), lambda m, x: m.relu(m.net1(torch.flatten(x, 1)))),
        _seq("net2"),
    ]


def _cnn(model: nn.Module) -> list[Piece]:
    def conv2(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(m.dropout1(F.max_pool2d(F.relu(m.conv2(x)), 2)), 1)

    return [
        Piece(("conv1",), lambda m, x: F.relu(m.conv1(x))),
        Piece(("conv2", "dropout1"), conv2),
        Piece(("fc1", "dropout2"), lambda m, x: m.dropout2(F.relu(m.fc1(x)))),
        Piece(("fc2",), lambda m, x: F.log_softmax(m.fc2(x), dim=1)),
    ]


def _cifar_cnn(model: nn.Module) -> list[Piece]:
    return [
        _seq("block1"),
        _seq("block2"),
        Piece(("block3", "dropout"), lambda m, x: m.dropout(torch.flatten(m.block3(x), 1))),
        Piece(("fc1", "dropout"), lambda m, x: m.dropout(F.relu(m.fc1(x)))),
        _seq("fc2"),
    ]


def _gpt(model: nn.Module) -> list[Piece]:
    def embed(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return m.drop(m.tok_emb(idx) + m.pos_emb(pos))

    blocks = [_seq(f"blocks.{i}") for i in range(len(model.blocks))]
    head = Piece(("norm", "lm_head"), lambda m, x: m.lm_head(m.norm(x)))
    return [Piece(("tok_emb", "pos_emb", "drop"), embed), *blocks, head]


# --model NAME -> the model's forward as pieces (run in order they equal ``model(x)``).
PIECES: dict[str, Callable[[nn.Module], list[Piece]]] = {
    "mlp": _mlp,
    "mlp2": _mlp2,
    "cnn": _cnn,
    "cifar-cnn": _cifar_cnn,
    "gpt": _gpt,
}


def pieces_of(model_name: str, model: nn.Module) -> list[Piece]:
    if model_name not in PIECES:
        raise UsageError(
            f"model {model_name!r} cannot be split into stages; --pp and --strategy model-parallel "
            f"support: {', '.join(PIECES)}"
        )
    pieces = PIECES[model_name](model)
    held = {f"{name}." for p in pieces for name in p.modules}
    for fqn, _ in model.named_parameters():
        if not any(fqn.startswith(prefix) for prefix in held):
            raise AssertionError(f"{model_name}: parameter {fqn} is in no pipeline piece")
    return pieces


def split(
    model_name: str, model: nn.Module, units: list[nn.Module], groups: int, what: str = "--pp"
) -> list[list[Piece]]:
    """Cut the pieces into ``groups`` runs, each with an even share of the layer units.

    Pieces without a layer unit (embeddings, the LM head) go with their neighbouring unit: those
    before the first unit to the first group, the others to the group of the unit before them.
    """
    pieces = pieces_of(model_name, model)
    unit_ids = {id(u) for u in units}
    is_unit = [any(id(model.get_submodule(n)) in unit_ids for n in p.modules) for p in pieces]
    n_units = sum(is_unit)
    if groups > n_units:
        raise UsageError(
            f"{what} {groups} is more than the {n_units} layer units of model {model_name!r}: "
            f"every stage needs at least one"
        )
    bounds = [g * n_units // groups for g in range(groups + 1)]
    out: list[list[Piece]] = [[] for _ in range(groups)]
    seen, group = 0, 0
    for piece, unit in zip(pieces, is_unit, strict=True):
        if unit:
            group = max(g for g in range(groups) if bounds[g] <= seen)
            seen += 1
        out[group].append(piece)
    return out


def describe(group: list[Piece]) -> str:
    """The modules of a run of pieces, for the log: ``[tok_emb, pos_emb, drop, blocks.0]``."""
    return f"[{', '.join(dict.fromkeys(n for piece in group for n in piece.modules))}]"


def _attach(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted name ``fqn`` below ``root``, making containers as needed."""
    *path, last = fqn.split(".")
    parent = root
    for part in path:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    if last not in parent._modules:
        parent.add_module(last, module)


class PiecewiseModule(nn.Module):
    """Runs a list of pieces in order; holds their modules under the original model's names.

    ``devices`` (one per piece) moves the activation to each piece's device first (model
    parallelism in one process); the result is returned on ``output_device``.
    """

    def __init__(
        self,
        model: nn.Module,
        pieces: list[Piece],
        devices: list[torch.device] | None = None,
        output_device: torch.device | None = None,
    ):
        super().__init__()
        for piece in pieces:
            for name in piece.modules:
                _attach(self, name, model.get_submodule(name))
        self.pieces = pieces
        self.devices = devices
        self.output_device = output_device
        self.pp_group: dist.ProcessGroup | None = None  # the stages' group, when a pipeline stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, piece in enumerate(self.pieces):
            if self.devices is not None:
                x = x.to(self.devices[i])
            x = piece.run(self, x)
        return x if self.output_device is None else x.to(self.output_device)


# ---------------------------------------------------------------------------------------------
def microbatches(pp_microbatches: int | None, pp: int) -> int:
    return pp_microbatches or 2 * pp


def check(cfg: TrainConfig, dims: ParallelDims, micro_batch: int) -> None:
    """Flag checks for ``--pp`` that need no model (the model's checks are in :func:`split`)."""
    if dims.pp == 1:
        return
    n = microbatches(cfg.pp_microbatches, dims.pp)
    if n < 1:
        raise UsageError(f"--pp-microbatches must be >= 1, got {n}")
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


def stage_module(model_name: str, model: nn.Module, units: list[nn.Module], mesh: DeviceMesh):
    """This rank's stage of ``model`` (on the meta device, not yet parallelised) and its units."""
    pp_mesh = mesh["pp"]
    groups = split(model_name, model, units, pp_mesh.size())
    if dist.get_rank() == 0:
        stages = "; ".join(f"stage {i} {describe(g)}" for i, g in enumerate(groups))
        log.info(f"fsdp2lab: pipeline: {stages}")
    module = PiecewiseModule(model, groups[pp_mesh.get_local_rank()])
    module.pp_group = pp_mesh.get_group()
    held = {id(m) for m in module.modules()}
    return module, [u for u in units if id(u) in held]


def stage_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of the pipeline stages, if ``model`` is one stage of a split model."""
    return getattr(model, "pp_group", None) if isinstance(model, PiecewiseModule) else None


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
        self._schedules: dict[tuple, tuple[object, PipelineStage]] = {}

    def _schedule(self, shape: torch.Size, train: bool):
        """The schedule for batches of ``shape`` and its stage."""
        key = (tuple(shape), train)
        if key not in self._schedules:
            stage = fix_stage_handshake(
                PipelineStage(
                    self.module, self.stage_index, self.num_stages, self.device, group=self.group
                )
            )
            if train:
                cls = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
                schedule = cls(stage, self.n_microbatches, loss_fn=self._loss)
            else:  # forward only: as many equal micro-batches as the batch allows
                schedule = ScheduleGPipe(stage, math.gcd(shape[0], self.n_microbatches))
            self._schedules[key] = (schedule, stage)
        return self._schedules[key]

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
