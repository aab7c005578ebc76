"""Training configuration: one dataclass that defines every ``fsdp2lab train`` flag and TOML key.

Precedence: dataclass defaults < ``--config FILE.toml`` < command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp2lab import consent, tomlio
from fsdp2lab.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STRATEGIES = ("fsdp2", "single", "ddp", "fsdp1", "model-parallel")
DATASETS = ("auto", "mnist", "fashion-mnist", "cifar10", "synthetic", "text")
OPTIMIZERS = ("adadelta", "adam", "adamw", "sgd")
SCHEDULERS = ("step", "cosine", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")
AC_MODES = ("none", "full", "selective", "op")
RECIPES = ("tuned", "seed")
DEFAULT_LR = {"adadelta": 1.0, "adam": 1e-3, "adamw": 1e-3, "sgd": 0.01}
# A recipe's values that only make sense together: set one of them and the recipe sets none.
_RECIPE_GROUPS = (("optimizer", "lr"),)


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text (and optional argparse extras: choices, metavar)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # model
    model: str = _opt(
        "cnn",
        "cnn, mlp, mlp2, cifar-cnn, gpt, hf:PATH (a pretrained Hugging Face folder, or a hub id "
        "in the local cache), or your own: pkg.module:NAME or path/file.py:NAME (a factory "
        "returning an nn.Module, or a ModelSpec)",
    )
    model_args: str = _opt("", "your model's factory keywords: 'k=v,...' (values read as JSON)")
    input_shape: str | None = _opt(
        None, "your classifier's input shape C,H,W (without it your model is a language model)"
    )
    loss: str | None = _opt(
        None, "your loss: pkg.module:fn or file.py:fn, fn(output, target) -> mean loss"
    )
    num_classes: int = _opt(10, "your classifier's number of classes (synthetic data)")
    fsdp_unit_class: str | None = _opt(
        None, "your model: the class of its sharding units (default: the most repeated block)"
    )
    dropout: float | None = _opt(
        None, "override every dropout probability (0 for exact parity runs)"
    )
    lora_rank: int | None = _opt(
        None,
        "train LoRA adapters of rank R (PEFT) on a frozen base instead of every weight "
        "(needs the hf extra)",
        metavar="R",
    )
    lora_alpha: float | None = _opt(None, "LoRA scaling numerator alpha (default: 2 x rank)")
    lora_dropout: float = _opt(0.0, "LoRA dropout on the adapters' input")
    lora_targets: str | None = _opt(
        None,
        "LoRA: comma-separated module names or name suffixes to adapt (default for hf: the "
        "model type's attention and MLP projections, e.g. q_proj,...,down_proj)",
        metavar="NAMES",
    )
    quantize_base: str | None = _opt(
        None,
        "QLoRA: store the frozen linear weights of the decoder layers in torchao's NF4 (blocks "
        "of 64, double-quantized scales; needs --lora-rank and the qlora extra; --strategy "
        "fsdp2 or single)",
        choices=("nf4",),
    )
    n_layers: int = _opt(4, "gpt: transformer blocks")
    d_model: int = _opt(128, "gpt: embedding width")
    n_heads: int = _opt(4, "gpt: attention heads")
    seq_len: int = _opt(64, "gpt: context length in tokens")
    vocab_size: int = _opt(256, "gpt: vocabulary size (256 = bytes)")
    # data
    dataset: str = _opt(
        "auto",
        "auto (mnist, else fashion-mnist, else synthetic) | mnist | fashion-mnist | cifar10 | "
        "synthetic | text | tokens:DIR (a token file from `fsdp2lab data prepare`) | your own: "
        "pkg.module:NAME or file.py:NAME returning (train, test)",
    )
    data_dir: str = _opt("./data", "where datasets are stored or downloaded")
    download: bool = _opt(True, "download a missing dataset (rank 0 only)")
    text_file: str | None = _opt(None, "dataset text: train the gpt on the bytes of this file")
    tokenizer: str | None = _opt(
        None,
        "dataset tokens:DIR: the tokenizer folder you train with; refused if DIR was made with "
        "another (their files' hashes differ)",
    )
    synthetic_size: int = _opt(8192, "synthetic: number of training samples (test set is 1/4)")
    num_workers: int = _opt(0, "data loader worker processes per rank")
    # batch and schedule
    global_batch_size: int | None = _opt(
        None, "samples per optimizer step over all ranks (default: the recipe's, else 64)"
    )
    batch_size: int | None = _opt(None, "per-rank micro-batch (the seeds' --batch-size)")
    test_batch_size: int | None = _opt(
        None,
        "per-rank evaluation batch (default: a language model's training micro-batch, one "
        "pipeline micro-batch under --pp, so evaluation holds no more logits than a step; "
        "classifiers: 1000, the seed's)",
    )
    grad_accum_steps: int = _opt(1, "micro-batches per optimizer step (see --grad-accum-reduce)")
    grad_accum_reduce: str = _opt(
        "auto",
        "FSDP2 gradient accumulation: every (reduce-scatter each micro-batch into the sharded "
        "gradients; HSDP all-reduces across replicas on the last only) | last (no communication "
        "before the last micro-batch: each rank holds unsharded gradients) | auto (every where "
        "parameters are sharded over more than one rank, else last)",
        choices=("auto", "every", "last"),
    )
    epochs: int = _opt(2, "training epochs")
    max_steps: int | None = _opt(
        None,
        "stop after this many optimizer steps (overrides --epochs; 0: build and load the model, "
        "save what is asked, exit)",
    )
    eval_every_steps: int | None = _opt(
        None, "also evaluate on the test set every N optimizer steps (always: after each epoch)"
    )
    target_accuracy: float | None = _opt(
        None,
        "stop at the first evaluation whose test accuracy is >= A (0.9 or 90 for 90%%); the "
        "time it took is logged and in the metrics file",
    )
    # optimisation
    recipe: str = _opt(
        "tuned",
        "defaults for what you leave unset: tuned (the model's measured recipe for its dataset; "
        "cnn on (Fashion-)MNIST: Adam lr 2e-3, dropout 0, global batch 128) | seed (the seed tutorial's: Adadelta "
        "lr 1.0, StepLR 0.7, the model's dropout, global batch 64)",
        choices=RECIPES,
    )
    optimizer: str | None = _opt(
        None, "optimizer (default: the recipe's, else adadelta)", choices=OPTIMIZERS
    )
    lr: float | None = _opt(
        None, "learning rate (default: the recipe's, else 1.0 adadelta, 1e-3 adam/adamw, 0.01 sgd)"
    )
    gamma: float = _opt(0.7, "StepLR decay per epoch (scheduler step)")
    scheduler: str = _opt("step", "LR schedule", choices=SCHEDULERS)
    warmup_steps: int = _opt(0, "linear warm-up steps (cosine)")
    weight_decay: float = _opt(0.0, "weight decay")
    momentum: float = _opt(0.9, "sgd momentum")
    max_grad_norm: float | None = _opt(None, "clip the global gradient norm to this value")
    seed: int = _opt(1, "random seed: weights, data order and dropout")
    # parallelism
    strategy: str = _opt("fsdp2", "how the model is parallelised", choices=STRATEGIES)
    dp_replicate: int = _opt(1, "replica groups (HSDP when > 1)")
    dp_shard: int = _opt(-1, "ranks each model copy is sharded over (-1: the rest)")
    reshard_after_forward: str = _opt(
        "true", "true | false | N (reshard to groups of N ranks)", metavar="{true,false,N}"
    )
    mixed_precision: str = _opt("fp32", "parameter dtype in compute", choices=PRECISIONS)
    cpu_offload: bool = _opt(False, "keep sharded parameters, gradients and optimizer state on CPU")
    prefetch: int = _opt(
        0, "explicit FSDP2 prefetch: all-gather N units ahead (0: FSDP2's default)"
    )
    fsdp_units: str = _opt(
        "layer",
        "FSDP2 units: layer (one fully_shard per layer unit) | auto (consecutive layer units "
        "grouped to >= --fsdp-unit-min-params parameters: fewer collectives for tiny models) | "
        "root (the whole model as one)",
        choices=("auto", "layer", "root"),
    )
    fsdp_unit_min_params: int | None = _opt(
        None,
        "--fsdp-units auto: fewest parameters per unit, a smaller rest joins the last; also "
        "the size from which a model's output head (final norm, vocabulary projection) is a "
        "unit of its own (default: 4,000,000 on CPU/gloo, 1,000,000 on GPU)",
    )
    activation_checkpointing: str = _opt(
        "none",
        "recompute unit activations in backward: none | full (every unit) | selective (every "
        "other unit: the 1st, 3rd, ...) | op (every unit keeps its attention and every other "
        "matmul's output, recomputes the rest)",
        choices=AC_MODES,
    )
    compile: bool = _opt(
        False, "torch.compile each unit in place (inductor; on CPU it needs a C++ compiler)"
    )
    # tensor and pipeline parallelism
    tp: int = _opt(1, "tensor-parallel degree (adds a tp mesh dimension)")
    pp: int = _opt(1, "pipeline-parallel degree (adds a pp mesh dimension)")
    pp_schedule: str = _opt("1f1b", "pipeline schedule", choices=("gpipe", "1f1b"))
    pp_microbatches: int | None = _opt(None, "pipeline micro-batches per step (default: 2 x pp)")
    # legacy FSDP1
    fsdp1_min_params: int | None = _opt(
        None, "fsdp1: size-based wrap policy threshold (default: one unit per layer)"
    )
    # checkpointing
    ckpt_dir: str | None = _opt(
        None, "folder of DCP checkpoints (DIR/step-N); none: no checkpoints"
    )
    ckpt_every_steps: int | None = _opt(None, "also checkpoint every N optimizer steps")
    keep_last: int = _opt(
        3,
        "keep the newest K complete checkpoints, delete older ones once a new one is complete "
        "(0: keep all)",
    )
    async_checkpoint: bool = _opt(
        False, "save (checkpoints, --save-hf) with dcp.async_save while training goes on"
    )
    resume: str = _opt("auto", "auto (newest complete checkpoint in --ckpt-dir) | never | PATH")
    # launch and runtime
    nproc_per_node: int | None = _opt(
        None, "standalone: local workers (default: GPUs, or 2 on CPU)"
    )
    device: str = _opt(
        "auto", "auto (cuda if present) | cpu | cuda", choices=("auto", "cpu", "cuda")
    )
    collective_timeout: float = _opt(
        120.0,
        "seconds a collective may wait for a peer; a rank silent for half of it is reported "
        "(start-up and checkpoint I/O get max(this, 600))",
    )
    host_malloc: str = _opt(
        "cached",
        "CPU runs: host memory a rank frees: cached (kept for the next step's tensors: no page "
        "faults per step; glibc, unless you tuned malloc yourself) | system (the C library's "
        "defaults)",
        choices=("cached", "system"),
    )
    on_nan: str = _opt(
        "stop",
        "a non-finite loss or gradient: stop (exit 1) | skip the step's update",
        choices=("stop", "skip"),
    )
    # output
    metrics_file: str | None = _opt(None, "JSON-lines metrics written by rank 0")
    log_every_steps: int = _opt(10, "metrics-file step line every N optimizer steps")
    log_level: str = _opt(
        "info",
        "rank 0's log level; the other ranks log warnings and errors only",
        choices=("debug", "info", "warning", "error"),
    )
    progress: str = _opt(
        "auto", "progress bar: auto (when a terminal) | on | off", choices=("auto", "on", "off")
    )
    save_model: str | None = _opt(
        None,
        "write a plain state dict at the end (default name <model>.pt; cnn: mnist_cnn.pt)",
        optional_value=True,
    )
    save_hf: str | None = _opt(
        None,
        "a Hugging Face model (--model hf:PATH): write DIR, a folder from_pretrained loads, at "
        "the end; every rank writes its own shards",
        metavar="DIR",
    )
    save_hf_every_steps: int | None = _opt(
        None, "also write --save-hf DIR every N optimizer steps (replacing the previous one)"
    )
    save_dtype: str | None = _opt(
        None,
        "--save-hf DIR's dtype of floating tensors (default: the source model's, as its "
        "config.json names it, else fp32; a PEFT adapter folder's adapters: as trained)",
        choices=PRECISIONS,
    )
    max_shard_size: str | None = _opt(
        None,
        "--save-hf DIR: safetensors files of at most SIZE (5GB, 500MB, 2GiB) and their index; "
        "default 5GB",
        metavar="SIZE",
    )
    merge: bool = _opt(
        False,
        "a LoRA run's --save-hf DIR: the base model with the adapters merged in (W + scale * B @ "
        "A per adapted linear), a folder from_pretrained loads (default: a PEFT adapter folder)",
    )
    tensorboard: str | None = _opt(
        None,
        "rank 0 writes TensorBoard logs to DIR (without DIR: runs/<model>-<strategy>-<time>, or "
        "with --ckpt-dir CKPT: CKPT's folder/runs/CKPT's name, the same on resume)",
        optional_value=True,
        metavar="DIR",
    )
    profile: str | None = _opt(
        None,
        "write a torch.profiler trace of --profile-steps steps after 5 warm-up steps to DIR "
        "(default: profile), and log where each step's time went",
        optional_value=True,
        metavar="DIR",
    )
    profile_steps: int = _opt(5, "steps the --profile trace records")
    memory_snapshot: str | None = _opt(
        None, "CUDA: record allocations and write torch's memory snapshot (a pickle) to FILE"
    )

    # ---- derived helpers -------------------------------------------------------------
    def reshard_value(self) -> bool | int:
        """``--reshard-after-forward`` as FSDP2 takes it."""
        value = self.reshard_after_forward.strip().lower()
        if value in ("true", "1", "yes"):
            return True
        if value in ("false", "0", "no"):
            return False
        try:
            return int(value)
        except ValueError:
            raise UsageError(
                f"--reshard-after-forward must be true, false or an integer, not {self.reshard_after_forward!r}"
            ) from None

    def dropout_or(self, default: float) -> float:
        """A model's dropout probability: ``--dropout`` if given, else the model's own."""
        return default if self.dropout is None else self.dropout

    def target_fraction(self) -> float | None:
        """``--target-accuracy`` as a fraction (given as 0.9 or as 90 for 90%)."""
        a = self.target_accuracy
        return None if a is None else (a / 100 if a > 1 else a)

    def with_recipe(self, tuned: Mapping[str, Any]) -> TrainConfig:
        """This config with what the user left unset (``None``) filled from the model's ``tuned``
        recipe (unless ``--recipe seed``), then from the seed's (Adadelta)."""
        recipe = dict(tuned) if self.recipe == "tuned" else {}
        for group in _RECIPE_GROUPS:
            if any(getattr(self, name) is not None for name in group):
                for name in group:
                    recipe.pop(name, None)
        if self.batch_size is not None:  # the seeds' per-rank batch decides the global one
            recipe.pop("global_batch_size", None)
        recipe.setdefault("optimizer", "adadelta")
        unset = {k: v for k, v in recipe.items() if getattr(self, k) is None}
        cfg = dataclasses.replace(self, **unset) if unset else self
        if cfg.lr is None:
            cfg = dataclasses.replace(cfg, lr=DEFAULT_LR[cfg.optimizer])
        return cfg

    def to_toml(self) -> str:
        """The resolved config as TOML (what ``--config`` reads back); unset keys are comments."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return tomlio.dumps(values, unset_as_comment=True).removesuffix("\n")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# Keys that older configs may hold, and why they are gone: a usage error that says so.
RETIRED = {
    "gloo_collectives": "FSDP2 on CPU uses gloo's own all-gather and reduce-scatter (the "
    "shared-memory and ring collectives are gone: they could not work across hosts)",
}
_DEFAULT = "<default>"  # a flag given without its optional value
# Keys whose value may name code (``module:attr``, ``file.py:attr``) that fsdp2lab imports and calls.
CODE_KEYS = ("model", "dataset", "loss")
# The prefix each key takes (a pretrained model, a token folder): it wins over ``module:attr``.
PREFIXES = {"model": "hf:", "dataset": "tokens:"}
# Keys naming what a run writes: a file names them only inside the working directory.
OUTPUT_PATH_KEYS = (
    "save_model",
    "save_hf",
    "metrics_file",
    "tensorboard",
    "profile",
    "memory_snapshot",
    "ckpt_dir",
)
# A flag given without its value names a default made from these keys.
_DEFAULT_MADE_FROM = {"save_model": ("model",), "tensorboard": ("ckpt_dir", "model")}


def is_reference(key: str, name: str) -> bool:
    """``name``, as ``key``'s value, names code: ``module:attr`` or ``file.py:attr`` (a built-in
    name has no colon; only ``model`` and ``dataset`` take a prefix, ``hf:`` and ``tokens:``)."""
    prefix = PREFIXES.get(key)
    return ":" in name and not (prefix and name.startswith(prefix))


def check_consent(values: Mapping[str, Any], where: str) -> None:
    """Code a file names runs only with ``--allow-code``: else a UsageError naming the key and
    ``where`` (the file), before anything is imported."""
    for key in CODE_KEYS:
        value = values.get(key)
        if isinstance(value, str):
            check_reference_consent(key, value, f"{where}: {key}")


def check_reference_consent(key: str, value: str, label: str) -> None:
    """``value``, as ``key``'s, names code only with consent: else a UsageError, ``label`` first."""
    if is_reference(key, value) and not consent.allows_code(key, value):
        raise consent.code_refused(label, value)


def check_output_paths(values: Mapping[str, Any], where: str, typed_as: str = "") -> None:
    """Output paths a file names stay inside the working directory (or the command line says
    otherwise): else a UsageError naming the key, ``where`` and the flag to type it with."""
    for key in OUTPUT_PATH_KEYS:
        value = values.get(key)
        if isinstance(value, str):
            flag = f"{typed_as}--{key.replace('_', '-')}"
            consent.check_output_path(key, value, where, flag)


def parse_size(text: str) -> int:
    """``5GB`` (powers of 10, as Hugging Face reads them), ``512MiB``, or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit, binary = match.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    size = int(float(number) * (1024 if binary else 1000) ** power)
    if size <= 0:
        raise UsageError(f"the size must be positive: {text!r}")
    return size


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    if "bool" in text:
        return bool
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field; every default is None so that unset flags can be told apart."""
    parser.add_argument(
        "--config", metavar="FILE.toml", help="TOML file of config keys (flags override it)"
    )
    parser.add_argument(
        "--allow-code", action="store_true", default=None, help=consent.ALLOW_CODE_HELP
    )
    parser.add_argument(
        "--allow-paths", action="store_true", default=None, help=consent.ALLOW_PATHS_HELP
    )
    for name in RETIRED:  # accepted only to say why it is gone
        parser.add_argument("--" + name.replace("_", "-"), help=argparse.SUPPRESS)
    for name, f in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = _field_type(f)
        extra = {k: v for k, v in f.metadata.items() if k in ("choices", "metavar")}
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.metadata.get("optional_value"):
            metavar = f.metadata.get("metavar", "PATH")
            parser.add_argument(
                flag, nargs="?", const=_DEFAULT, default=None, metavar=metavar, help=help_text
            )
        elif kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, type=kind, default=None, help=help_text, **extra)


def read_toml_file(path: str, what: str = "config file") -> dict[str, Any]:
    """The parsed TOML at ``path``; a missing file or bad TOML is a UsageError naming ``what``."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{what} not found: {path}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))  # TOML is UTF-8
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{what} {path} is not valid TOML: {e}") from None


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file; unknown keys and wrong types are a UsageError."""
    data = read_toml_file(path)
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in RETIRED:
            raise UsageError(f"config file {path}: {key} is no longer read: {RETIRED[name]}")
        if name not in _FIELDS:
            known = ", ".join(sorted(_FIELDS))
            raise UsageError(f"config file {path}: unknown key {key!r} (known keys: {known})")
        if name == "model_args" and isinstance(value, dict):  # a [model_args] table
            value = ",".join(f"{k}={json.dumps(v)}" for k, v in value.items())
        kind = _field_type(_FIELDS[name])
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise UsageError(
                f"config file {path}: {key} must be {kind.__name__}, got {type(value).__name__} {value!r}"
            )
        values[name] = value
    return values


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Merge defaults, the TOML file and the flags into a validated TrainConfig."""
    for name in RETIRED:
        if getattr(args, name, None) is not None:
            raise UsageError(f"--{name.replace('_', '-')} is no longer read: {RETIRED[name]}")
    consent.register(
        allow_code=getattr(args, "allow_code", None),
        allow_paths=getattr(args, "allow_paths", None),
        typed=[(key, getattr(args, key, None)) for key in (*CODE_KEYS, *OUTPUT_PATH_KEYS)],
    )
    values: dict[str, Any] = {}
    used: dict[str, Any] = {}
    if getattr(args, "config", None):
        from_file = load_toml(args.config)
        used = {k: v for k, v in from_file.items() if getattr(args, k, None) is None}
        check_consent(used, f"config file {args.config}")
        values.update(from_file)
    for name in _FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    cfg = TrainConfig(**values)
    if cfg.save_model == _DEFAULT:
        stem = cfg.model.rpartition(":")[2]  # your model: its factory's name
        cfg.save_model = "mnist_cnn.pt" if cfg.model == "cnn" else f"{stem}.pt"
    if cfg.profile == _DEFAULT:
        cfg.profile = "profile"
    if cfg.tensorboard == _DEFAULT:
        cfg.tensorboard = default_tensorboard_dir(cfg)
    if used:
        check_output_paths(_paths_from_file(args, used, cfg), f"config file {args.config}")
    validate_basic(cfg)
    return cfg


def _paths_from_file(
    args: argparse.Namespace, used: Mapping[str, Any], cfg: TrainConfig
) -> dict[str, Any]:
    """The output paths a config file chose: its own keys' values, and the default names a flag
    typed without its value made from the file's keys (``--save-model`` from its ``model``)."""
    chosen = {}
    for key in OUTPUT_PATH_KEYS:
        made_of = _DEFAULT_MADE_FROM.get(key, ())
        made_from_file = getattr(args, key, None) == _DEFAULT and any(k in used for k in made_of)
        if key in used or made_from_file:
            chosen[key] = getattr(cfg, key)
    return chosen


def default_tensorboard_dir(cfg: TrainConfig) -> str:
    """``--tensorboard`` without DIR: next to the checkpoints (so a resumed run continues the same
    curves), else a new folder per run."""
    if cfg.ckpt_dir:
        ckpt = Path(cfg.ckpt_dir)
        return str(ckpt.parent / "runs" / ckpt.name)
    return f"runs/{cfg.model}-{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"


# Numeric flags and the values they take: (lowest, highest, lowest is allowed). None: unbounded.
_BOUNDS: dict[str, tuple[float | None, float | None, bool]] = {
    **{
        name: (1, None, True)
        for name in (
            "n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "synthetic_size",
            "global_batch_size", "batch_size", "test_batch_size", "grad_accum_steps", "epochs",
            "dp_replicate", "tp", "pp", "pp_microbatches", "fsdp1_min_params",
            "fsdp_unit_min_params", "ckpt_every_steps", "save_hf_every_steps", "nproc_per_node", "num_classes",
            "log_every_steps", "eval_every_steps", "profile_steps", "lora_rank",
        )
    },
    **{name: (0, None, True) for name in ("lr", "weight_decay", "warmup_steps", "num_workers", "seed", "prefetch", "keep_last", "max_steps")},
    "collective_timeout": (0, None, False),
    "gamma": (0, None, False),
    "max_grad_norm": (0, None, False),
    "momentum": (0, 1, True),
    "dropout": (0, 1, True),
    "lora_dropout": (0, 1, True),
    "lora_alpha": (0, None, False),
}  # fmt: skip


def _check_bounds(cfg: TrainConfig) -> None:
    for name, (low, high, low_ok) in _BOUNDS.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        too_low = low is not None and (value < low or (value == low and not low_ok))
        too_high = high is not None and value >= high
        if not math.isfinite(value) or too_low or too_high:
            if high is not None:
                want = f"in [{low}, {high})" if low_ok else f"in ({low}, {high})"
            else:
                want = f">= {low}" if low_ok else f"> {low}"
            raise UsageError(f"{flag} must be {want}, got {value}")


def validate_basic(cfg: TrainConfig) -> None:
    """Checks that need no knowledge of the world size or the data."""
    for name in _FIELDS:
        choices = _FIELDS[name].metadata.get("choices")
        if choices and getattr(cfg, name) not in (*choices, None):
            raise UsageError(
                f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, not {getattr(cfg, name)!r}"
            )
    if cfg.dataset not in DATASETS and ":" not in cfg.dataset:
        raise UsageError(
            f"--dataset must be one of {', '.join(DATASETS)} or MODULE:NAME / FILE.py:NAME, "
            f"not {cfg.dataset!r}"
        )
    _check_bounds(cfg)
    if cfg.dp_shard < 1 and cfg.dp_shard != -1:
        raise UsageError(f"--dp-shard must be >= 1 or -1 (the rest), got {cfg.dp_shard}")
    cfg.reshard_value()
    a = cfg.target_accuracy
    if a is not None and not (0 < a <= 100 and math.isfinite(a)):
        raise UsageError(f"--target-accuracy must be in (0, 1] or (1, 100] (percent), got {a}")
    if cfg.dataset == "text" and not cfg.text_file:
        raise UsageError("--dataset text needs --text-file PATH")
    if cfg.lora_rank is None:
        for name in ("lora_alpha", "lora_targets"):
            if getattr(cfg, name) is not None:
                raise UsageError(f"--{name.replace('_', '-')} needs --lora-rank R")
    if cfg.quantize_base and cfg.lora_rank is None:
        raise UsageError(f"--quantize-base {cfg.quantize_base} needs --lora-rank R")
    for name in ("save_hf_every_steps", "save_dtype", "max_shard_size"):
        if getattr(cfg, name) and not cfg.save_hf:
            raise UsageError(f"--{name.replace('_', '-')} needs --save-hf DIR")
    if cfg.max_shard_size is not None:
        try:
            parse_size(cfg.max_shard_size)
        except UsageError as e:
            raise UsageError(f"--max-shard-size: {e}") from None
    if cfg.merge and (not cfg.save_hf or cfg.lora_rank is None):
        raise UsageError("--merge needs --lora-rank R and --save-hf DIR")
    if not cfg.ckpt_dir and cfg.ckpt_every_steps:
        raise UsageError("--ckpt-every-steps needs --ckpt-dir DIR")
    if cfg.async_checkpoint and not (cfg.ckpt_dir or cfg.save_hf):
        raise UsageError("--async-checkpoint needs --ckpt-dir DIR or --save-hf DIR")
