"""The run plan: every check and derivation of a run, done once, into one immutable object.

``resolve(cfg, world_size)`` checks the flags against the world size and the model, derives the
device type, mesh degrees, batch sizes, learning rate, sharding units and pipeline stages, and
builds the model once on the meta device (no memory) to read them from. It does not look at the
machine it runs on beyond whether CUDA is there (``device_type`` fixes even that), so it plans a
cluster's run as well as this one. ``check_machine(plan)`` then checks what this machine must
provide (a writable checkpoint folder, a ``--save-hf`` folder it may write with room for the
save, a compiler for ``--compile``, CUDA for ``--memory-snapshot``); ``resolve_here`` does both. The launcher resolves before any worker
starts, so bad input is one message and exit code 2; each worker resolves its own plan once, and
the trainer, the strategies and ``bench`` read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp2lab.config import TrainConfig, is_reference
from fsdp2lab.data import tokens
from fsdp2lab.errors import UsageError
from fsdp2lab.models import get_spec, lora, quantize
from fsdp2lab.models.materialize import build_on_meta
from fsdp2lab.models.spec import ModelSpec, logits_of
from fsdp2lab.models.user import load_object
from fsdp2lab.parallel import model_parallel, pp, tp
from fsdp2lab.parallel.compile import check_compile_support
from fsdp2lab.parallel.strategies import Strategy, get_strategy
from fsdp2lab.runtime.mesh import ParallelDims
from fsdp2lab.runtime.torch_compat import cuda_memory_history


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig
    world_size: int
    device_type: str  # "cuda" or "cpu"
    strategy: Strategy
    dims: ParallelDims
    global_batch: int  # samples per optimizer step, all ranks
    micro_batch: int  # samples per rank per forward/backward
    spec: ModelSpec
    units: tuple[str, ...]  # the model's sharding (and AC, compile) units
    head: tuple[str, ...] = ()  # the output head's modules: a sharding unit after the layers
    # Module names per pipeline stage (--pp) or per device (--strategy model-parallel).
    stages: tuple[tuple[str, ...], ...] = ()
    n_microbatches: int = 1  # --pp: micro-batches per step
    # parameters FSDP2 leaves whole on every rank: an NF4 base on one shard rank (FSDP2's
    # one-rank all-gather passes on only the first of NF4's parts), made NF4 in the compute dtype
    unsharded: tuple[str, ...] = ()
    params_total: int = 0
    loss: Callable | None = None  # --loss, else the model's own; None: cross-entropy
    # The model built on the meta device; the trainer parallelises a copy of it.
    meta_model: nn.Module = field(default=None, repr=False, compare=False)  # type: ignore[assignment]


def resolve(cfg: TrainConfig, world_size: int, device_type: str | None = None) -> RunPlan:
    """Check ``cfg`` against ``world_size`` and the model; UsageError names the first problem.

    ``device_type`` ("cuda" or "cpu"): the devices the ranks will have (default: CUDA where
    ``--device`` allows it and this machine has it)."""
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
    if cfg.quantize_base:
        quantize.check(cfg)
    if cfg.lora_rank is not None:
        lora.check(cfg)
    if (cfg.compile or cfg.activation_checkpointing != "none") and cfg.strategy in (
        "fsdp1",
        "model-parallel",
    ):
        raise UsageError(
            f"--activation-checkpointing and --compile work with --strategy fsdp2, ddp and "
            f"single, not {cfg.strategy}"
        )
    dims = ParallelDims.resolve(world_size, cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp)
    spec = get_spec(cfg.model, cfg)
    cfg = dataclasses.replace(cfg, **spec.fixed).with_recipe(
        spec.recipes.get(_dataset(cfg, spec), {})
    )
    global_batch, micro_batch = batch_sizes(cfg, dims.dp)

    dataset = _dataset(cfg, spec)
    your_dataset = is_reference("dataset", cfg.dataset)
    if cfg.dataset != "auto" and not your_dataset and dataset not in spec.datasets:
        raise UsageError(
            f"dataset {dataset!r} does not fit model {spec.name!r}; it takes: {', '.join(spec.datasets)}"
        )
    model = build_on_meta(
        lambda: spec.build(cfg), spec.real_buffers
    )  # the model's own checks, at no memory cost
    units = tuple(spec.units(model))
    _check_names(model, units, "sharding unit")
    head = tuple(spec.head(model))
    _check_names(model, head, "head module")
    if cfg.save_hf:
        _check_save_hf(cfg, model)
    if cfg.lora_rank is not None:  # adapters on the meta model: sharded with their layer
        cfg, spec, model = _with_lora(cfg, spec, model)
    unsharded: tuple[str, ...] = ()
    if cfg.quantize_base:
        spec, strategy, unsharded = _with_nf4_base(cfg, spec, strategy, model, units, dims)
    if is_reference("model", cfg.model) and not your_dataset:  # checked when it is loaded
        classify = spec.task == "classify"
        classes = spec.num_classes if classify else cfg.vocab_size
        what = f"--num-classes {classes}" if classify else f"--vocab-size {classes}"
        check_model_takes(model, spec.name, sample_input(spec, cfg), classes, what)

    if dims.tp > 1:
        tp.check(spec, model, dims.tp)
    stages: tuple[tuple[str, ...], ...] = ()
    n_microbatches = 1
    if dims.pp > 1:
        n_microbatches = pp.microbatches(cfg.pp_microbatches, dims.pp)
        pp.check(cfg, dims, micro_batch, n_microbatches)
        stages = pp.split(spec, model, units, dims.pp, "--pp")
    elif cfg.strategy == "model-parallel":
        if spec.pipeline_stage is not None:
            raise UsageError(
                f"--strategy model-parallel: model {spec.name!r} is split only into pipeline "
                "stages (--pp with --strategy fsdp2)"
            )
        n_groups = model_parallel.group_count(cfg.device, len(units))
        stages = pp.split(spec, model, units, n_groups, "--strategy model-parallel")
    if cfg.test_batch_size is None:
        cfg = dataclasses.replace(
            cfg, test_batch_size=eval_batch_size(spec, micro_batch, n_microbatches)
        )

    device_type = device_type or _device_type(cfg.device)
    if cfg.cpu_offload and cfg.mixed_precision == "fp16" and device_type == "cuda":
        # Its inf check all-reduces a flag beside the host-side gradients, over NCCL, and its
        # CUDA scale update takes no host flag.
        raise UsageError(
            "--cpu-offload with --mixed-precision fp16 on CUDA: torch's gradient scaler cannot "
            "check gradients kept on the host; use --mixed-precision bf16, or no --cpu-offload"
        )
    return RunPlan(
        cfg=cfg,
        world_size=world_size,
        device_type=device_type,
        strategy=strategy,
        dims=dims,
        global_batch=global_batch,
        micro_batch=micro_batch,
        spec=spec,
        units=units,
        head=head,
        stages=stages,
        n_microbatches=n_microbatches,
        unsharded=unsharded,
        params_total=sum(p.numel() for p in model.parameters()),
        loss=_loss(cfg, spec),
        meta_model=model,
    )


def _with_nf4_base(
    cfg: TrainConfig,
    spec: ModelSpec,
    strategy: Strategy,
    model: nn.Module,
    units: tuple[str, ...],
    dims: ParallelDims,
) -> tuple[ModelSpec, Strategy, tuple[str, ...]]:
    """``--quantize-base``: the spec and strategy that make the base NF4 (on meta before FSDP2
    shards it, each shard quantized as loaded; ``single``: whole, after loading), and the base's
    weights FSDP2 leaves whole (on one shard rank)."""
    quantize.check_sizes(model, units, dims.dp_shard, cfg)
    if strategy.materialize_first:
        load = quantize.after_load(spec.load_weights, units)
        return dataclasses.replace(spec, load_weights=load), strategy, ()
    unsharded = ()
    if dims.dp_shard == 1:
        unsharded = tuple(f"{name}.weight" for name, _ in quantize.base_linears(model, units))
    parallelize = quantize.before_sharding(strategy.parallelize, units)
    return spec, dataclasses.replace(strategy, parallelize=parallelize), unsharded


def _check_save_hf(cfg: TrainConfig, model: nn.Module) -> None:
    """``--save-hf`` writes a Hugging Face folder: a model with a Hugging Face config, whole
    weights (not LoRA adapters), and a torch whose HF writer takes every rank's shards."""
    from fsdp2lab.checkpoint.state import hf_config_of
    from fsdp2lab.runtime.torch_compat import hf_sharded_save_missing

    if hf_config_of(model) is None:
        raise UsageError(
            f"--save-hf writes a Hugging Face folder: model {cfg.model!r} has no Hugging Face "
            "config (use --model hf:PATH, or --save-model)"
        )
    missing = hf_sharded_save_missing()
    if missing:
        raise UsageError(f"--save-hf: {missing}; use --ckpt-dir, then `fsdp2lab ckpt export`")


def _with_lora(
    cfg: TrainConfig, spec: ModelSpec, model: nn.Module
) -> tuple[TrainConfig, ModelSpec, nn.Module]:
    """LoRA adapters injected into the meta ``model`` (base frozen, in :func:`lora.base_dtype`),
    their defaults filled in ``cfg``, and ``spec`` loading the base then initialising them."""
    targets = lora.targets(cfg, model)
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
    cfg = dataclasses.replace(cfg, lora_alpha=alpha, lora_targets=",".join(targets))
    model = lora.apply_lora(model, cfg, lora.base_dtype(cfg, spec.source))
    spec = dataclasses.replace(spec, load_weights=lora.with_adapters(spec.load_weights, cfg.seed))
    return cfg, spec, model


def check_machine(plan: RunPlan) -> None:
    """What this machine must provide for ``plan``: UsageError names the first thing missing."""
    cfg = plan.cfg
    if _dataset(cfg, plan.spec) == "tokens":  # its header against the model and --tokenizer
        tokens.check(cfg.dataset.removeprefix(tokens.PREFIX), cfg.vocab_size, cfg.seq_len,
                     cfg.tokenizer)  # fmt: skip
    if cfg.compile:
        reason = check_compile_support(plan.device_type)
        if reason:
            raise UsageError(reason)
    if cfg.memory_snapshot and plan.device_type != "cuda":
        raise UsageError(
            "--memory-snapshot needs a CUDA device (torch.cuda.memory); this run trains on CPU. "
            "On CPU, the summary and --tensorboard show peak RSS and its growth per rank"
        )
    if cfg.memory_snapshot and cuda_memory_history() is None:
        raise UsageError(
            "--memory-snapshot: this torch has no torch.cuda.memory._record_memory_history / "
            "_dump_snapshot"
        )
    if cfg.ckpt_dir:
        from fsdp2lab.checkpoint.layout import check_writable

        check_writable(cfg.ckpt_dir)
    if cfg.save_hf:  # every refusal of its folder, and the free space, before any worker starts
        from fsdp2lab.checkpoint.hf_save import check_target

        check_target(cfg, plan.meta_model, plan.spec.source)


def resolve_here(cfg: TrainConfig, world_size: int) -> RunPlan:
    """The run plan for ranks on this machine, and this machine's checks of it."""
    plan = resolve(cfg, world_size)
    check_machine(plan)
    return plan


def _dataset(cfg: TrainConfig, spec: ModelSpec) -> str:
    """The dataset the run asks for (``auto``: the model's first choice; ``tokens:DIR``:
    ``tokens``)."""
    if tokens.is_tokens(cfg.dataset):
        return "tokens"
    return spec.default_dataset if cfg.dataset == "auto" else cfg.dataset


def sample_input(spec: ModelSpec, cfg: TrainConfig, batch: int = 2) -> torch.Tensor:
    """A meta batch shaped as the dataset ``cfg`` asks for (``auto``: the model's default)."""
    dataset = _dataset(cfg, spec)
    if dataset in ("text", "tokens") or (dataset == "synthetic" and spec.task == "lm"):
        return torch.zeros(batch, cfg.seq_len, dtype=torch.long, device="meta")
    shape = {"cifar10": (3, 32, 32), "synthetic": spec.input_shape}.get(dataset, (1, 28, 28))
    return torch.zeros(batch, *shape, device="meta")


def check_model_takes(
    model: nn.Module, name: str, x: torch.Tensor, classes: int, what: str
) -> None:
    """Run your model on the meta batch ``x``: a mismatch with the data is one message, not a
    traceback per rank. Errors that only the meta device raises are left to the real run."""
    shape = f"{tuple(x.shape)} ({str(x.dtype).removeprefix('torch.')})"
    try:
        with torch.no_grad():
            out = logits_of(model(x))
    except Exception as e:  # your model's code: whatever it raises
        if isinstance(e, (NotImplementedError, RuntimeError)) and "meta" in str(e).lower():
            return
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsageError(
            f"model {name} does not take the data's batches of shape {shape}: "
            f"{type(e).__name__}: {first}"
        ) from None
    if out.shape[-1] < classes:
        raise UsageError(
            f"model {name} outputs {out.shape[-1]} logits per sample, fewer than {what}"
        )


def check_dataset(plan: RunPlan, train_set) -> None:
    """Your dataset (``--dataset file.py:NAME``), once loaded: does the model take its batches?"""
    if is_reference("dataset", plan.cfg.dataset):
        x = train_set.__getitems__([0])[0].to("meta")
        classes = int(train_set.targets.max()) + 1
        check_model_takes(plan.meta_model, plan.spec.name, x, classes, f"the {classes} classes")


def _loss(cfg: TrainConfig, spec: ModelSpec) -> Callable | None:
    if not cfg.loss:
        return spec.loss
    loss = load_object(cfg.loss, "--loss", "loss")
    if not callable(loss):
        raise UsageError(f"--loss {cfg.loss}: {type(loss).__name__} is not a function")
    return loss


def eval_batch_size(spec: ModelSpec, micro_batch: int, n_microbatches: int) -> int:
    """The default ``--test-batch-size``: a language model's evaluation forward takes what a
    training forward does (one pipeline micro-batch under ``--pp``), so its logits are no larger
    than a step's; a classifier's (10 logits a sample) takes the seed's 1000."""
    return micro_batch // n_microbatches if spec.task == "lm" else 1000


def _device_type(preference: str) -> str:
    return "cuda" if preference != "cpu" and torch.cuda.is_available() else "cpu"


def _check_names(model: nn.Module, names: tuple[str, ...], what: str) -> None:
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise UsageError(f"{what} {name!r} is not a module of the model") from None


def batch_sizes(cfg: TrainConfig, dp: int) -> tuple[int, int]:
    """(global batch per optimizer step, per-rank micro-batch) from --global-batch-size / --batch-size."""
    k = cfg.grad_accum_steps
    given_both = cfg.global_batch_size is not None and cfg.batch_size is not None
    if given_both and cfg.global_batch_size != cfg.batch_size * dp * k:
        raise UsageError(
            f"--global-batch-size {cfg.global_batch_size} disagrees with --batch-size {cfg.batch_size} x "
            f"data-parallel ranks {dp} x grad-accum-steps {k} = {cfg.batch_size * dp * k}; give one of them"
        )
    if cfg.batch_size is not None:
        return cfg.batch_size * dp * k, cfg.batch_size
    global_batch = cfg.global_batch_size or 64
    if global_batch % (dp * k):
        raise UsageError(
            f"--global-batch-size {global_batch} is not divisible by data-parallel ranks {dp} x "
            f"grad-accum-steps {k} = {dp * k}"
        )
    return global_batch, global_batch // (dp * k)
