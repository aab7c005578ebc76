"""The run plan: every check and derivation of a run, done once, into one immutable object.

``resolve(cfg, world_size)`` checks the flags against the world size and the model, derives the
mesh degrees, batch sizes, sharding units and pipeline stages, and builds the model once on the
meta device (no memory) to read them from. The launcher resolves before any worker starts, so bad
input is one message and exit code 2; each worker resolves its own plan once, and the trainer,
the strategies and ``bench`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp2lab.config import TrainConfig
from fsdp2lab.data.loader import batch_sizes
from fsdp2lab.errors import UsageError
from fsdp2lab.models import get_spec
from fsdp2lab.models.materialize import build_on_meta
from fsdp2lab.models.spec import ModelSpec, logits_of
from fsdp2lab.models.user import is_reference
from fsdp2lab.parallel import model_parallel, pp, tp
from fsdp2lab.parallel.strategies import Strategy, get_strategy
from fsdp2lab.runtime.mesh import ParallelDims


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig
    world_size: int
    strategy: Strategy
    dims: ParallelDims
    global_batch: int  # samples per optimizer step, all ranks
    micro_batch: int  # samples per rank per forward/backward
    spec: ModelSpec
    units: tuple[str, ...]  # the model's sharding (and AC, compile) units
    # Module names per pipeline stage (--pp) or per device (--strategy model-parallel).
    stages: tuple[tuple[str, ...], ...] = ()
    n_microbatches: int = 1  # --pp: micro-batches per step
    params_total: int = 0
    # The model built on the meta device; the trainer parallelises a copy of it.
    meta_model: nn.Module = field(default=None, repr=False, compare=False)  # type: ignore[assignment]


def resolve(cfg: TrainConfig, world_size: int) -> RunPlan:
    """Check ``cfg`` against ``world_size`` and the model; UsageError names the first problem."""
    strategy = get_strategy(cfg.strategy)
    if strategy.max_world_size is not None and world_size > strategy.max_world_size:
        raise UsageError(
            f"--strategy {strategy.name} runs in one process, but {world_size} ranks were started "
            f"(use --nproc-per-node 1, or another strategy)"
        )
    if (cfg.tp > 1 or cfg.pp > 1) and cfg.strategy != "fsdp2":
        message = f"--tp/--pp compose with FSDP2: use --strategy fsdp2, not {cfg.strategy}"
        if cfg.strategy == "model-parallel":
            message += " (it places layers on the devices of one process)"
        raise UsageError(message)
    strategy.check(cfg)
    if cfg.memory_snapshot:
        from fsdp2lab.training.memory_snapshot import check_available

        check_available(cfg.device)
    dims = ParallelDims.resolve(world_size, cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp)
    global_batch, micro_batch = batch_sizes(cfg, dims.dp)

    spec = get_spec(cfg.model, cfg)
    if cfg.dataset != "auto" and cfg.dataset not in spec.datasets:
        raise UsageError(
            f"dataset {cfg.dataset!r} does not fit model {spec.name!r}; it takes: {', '.join(spec.datasets)}"
        )
    model = build_on_meta(
        lambda: spec.build(cfg), spec.real_buffers
    )  # the model's own checks, at no memory cost
    units = tuple(spec.units(model))
    _check_names(model, units, "sharding unit")
    if is_reference(cfg.model):
        _check_takes_the_data(model, spec, cfg)

    if dims.tp > 1:
        tp.check(spec, model, dims.tp)
    stages: tuple[tuple[str, ...], ...] = ()
    n_microbatches = 1
    if dims.pp > 1:
        n_microbatches = pp.microbatches(cfg.pp_microbatches, dims.pp)
        pp.check(cfg, dims, micro_batch, n_microbatches)
        stages = pp.split(spec, model, units, dims.pp, "--pp")
    elif cfg.strategy == "model-parallel":
        n_groups = model_parallel.group_count(cfg.device, len(units))
        stages = pp.split(spec, model, units, n_groups, "--strategy model-parallel")

    if cfg.ckpt_dir:
        from fsdp2lab.checkpoint.layout import check_writable

        check_writable(cfg.ckpt_dir)
    return RunPlan(
        cfg=cfg,
        world_size=world_size,
        strategy=strategy,
        dims=dims,
        global_batch=global_batch,
        micro_batch=micro_batch,
        spec=spec,
        units=units,
        stages=stages,
        n_microbatches=n_microbatches,
        params_total=sum(p.numel() for p in model.parameters()),
        meta_model=model,
    )


def sample_input(spec: ModelSpec, cfg: TrainConfig, batch: int = 2) -> torch.Tensor:
    """A meta batch shaped as the dataset ``cfg`` asks for (``auto``: the model's default)."""
    dataset = spec.default_dataset if cfg.dataset == "auto" else cfg.dataset
    if dataset == "text" or (dataset == "synthetic" and spec.task == "lm"):
        return torch.zeros(batch, cfg.seq_len, dtype=torch.long, device="meta")
    shape = {"cifar10": (3, 32, 32), "synthetic": spec.input_shape}.get(dataset, (1, 28, 28))
    return torch.zeros(batch, *shape, device="meta")


def _check_takes_the_data(model: nn.Module, spec: ModelSpec, cfg: TrainConfig) -> None:
    """Run your model on a meta batch of the data's shape: a mismatch is one message, not a
    traceback per rank. Errors that only the meta device raises are left to the real run."""
    x = sample_input(spec, cfg)
    shape = f"{tuple(x.shape)} ({str(x.dtype).removeprefix('torch.')})"
    try:
        with torch.no_grad():
            out = logits_of(model(x))
    except Exception as e:  # your model's code: whatever it raises
        if isinstance(e, (NotImplementedError, RuntimeError)) and "meta" in str(e).lower():
            return
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsageError(
            f"model {spec.name} does not take the data's batches of shape {shape}: "
            f"{type(e).__name__}: {first}"
        ) from None
    classes = spec.num_classes if spec.task == "classify" else cfg.vocab_size
    if out.shape[-1] < classes:
        what = "--num-classes" if spec.task == "classify" else "--vocab-size"
        raise UsageError(
            f"model {spec.name} outputs {out.shape[-1]} logits per sample, fewer than "
            f"{what} {classes}"
        )


def _check_names(model: nn.Module, names: tuple[str, ...], what: str) -> None:
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise UsageError(f"{what} {name!r} is not a module of the model") from None
