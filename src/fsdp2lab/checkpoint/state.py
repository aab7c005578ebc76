"""What a checkpoint holds, and how a trainer's state goes into it and comes back out.

Top-level keys of the DCP state dict:

- ``model``, ``optim``: from ``get_state_dict`` (sharded DTensors under FSDP2; DCP reshards them
  on load, so any world size, mesh or strategy can read them);
- ``scheduler``: the LR scheduler's state dict;
- ``train_state``: epoch, step, samples seen, samples into the epoch (world-size independent);
- ``scaler``: with ``--mixed-precision fp16``, the gradient scaler's state (scale, growth tracker);
- ``run``: JSON of how the run was set up (model, strategy, world size, mesh, config, and a
  Hugging Face model's config as ``hf_config``, which ``ckpt export`` writes as ``config.json``;
  a LoRA run's base folder, ``lora_base``, and a QLoRA run's base quantization,
  ``quantized_base``: neither base is saved);
- ``ranks.<R>``: rank R's own state: CPU (and CUDA) RNG states (uint8 tensors) and its data
  loader's state dict as JSON text. Every rank writes only its own entry.

Everything here is plain data (tensors, numbers, strings): reading a checkpoint runs no code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler

from fsdp2lab.checkpoint.layout import Checkpoint
from fsdp2lab.config import TrainConfig
from fsdp2lab.data.tokens import TOKENIZER_FILES
from fsdp2lab.errors import UsageError
from fsdp2lab.models import lora, quantize
from fsdp2lab.runtime.distributed import Runtime

# Optimizer state keyed by parameter name (not by position in param_groups): the same keys
# whatever the strategy or pipeline layout, so any layout can load what another saved.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """:data:`OPTIONS`; for a model with frozen parameters (a LoRA run's base) also
    ``ignore_frozen_params``: a checkpoint holds what training changes, the base is read from its
    folder again (its fingerprint checked: :func:`check_base`). Loading is then not strict about
    the frozen keys; :func:`check_fits` checks the trainable ones, both ways."""
    if all(p.requires_grad for p in model.parameters()):
        return OPTIONS
    return replace(OPTIONS, ignore_frozen_params=True, strict=False)


class Checkpointable(Protocol):
    """What a checkpoint reads from a trainer and restores into it (``training.trainer.Trainer``)."""

    plan: Any  # the run plan: dims, global batch, the model built on meta
    cfg: TrainConfig
    runtime: Runtime
    device: torch.device
    mesh: DeviceMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    scaler: Any  # torch.amp.GradScaler under fp16, else None
    state: Any  # a dataclass of counters (``training.hooks.TrainState``)
    sampler: Any  # ``data.sampler.DistributedBatchSampler``
    loader: Any  # a stateful data loader


MODEL, OPTIM, SCHEDULER, TRAIN_STATE, RUN, RANKS, SCALER = (
    "model",
    "optim",
    "scheduler",
    "train_state",
    "run",
    "ranks",
    "scaler",
)
FULL_CONTENTS = [MODEL, OPTIM, SCHEDULER, TRAIN_STATE, RUN, RANKS]
GENERATION_FILE = "generation_config.json"
LORA_BASE = "lora_base"  # run info: a LoRA run's base folder and its fingerprint
QUANTIZED_BASE = "quantized_base"  # run info: a QLoRA run's base quantization (quantize.record)
# Tokenizer files that decide no token ids (so not in a token file's hash), copied too.
TOKENIZER_EXTRAS = ("added_tokens.json", "chat_template.jinja")


def run_info(trainer: Checkpointable) -> dict:
    """How the run is set up: recorded in the checkpoint and its COMPLETE mark."""
    cfg, mesh = trainer.cfg, trainer.mesh
    info = {
        "model": cfg.model,
        "strategy": cfg.strategy,
        "world_size": trainer.runtime.world_size,
        "mesh": {"names": list(mesh.mesh_dim_names or ()), "shape": list(mesh.shape)},
        "dp": trainer.plan.dims.dp,
        "global_batch": trainer.plan.global_batch,
        "micro_batch_global": trainer.sampler.micro_global,
        "optimizer": cfg.optimizer,
        "scheduler": cfg.scheduler,
        "device": trainer.device.type,
        "config": asdict(cfg),
    }
    hf_config = hf_config_of(trainer.plan.meta_model)  # unwrapped, the whole model (also --pp)
    if hf_config is not None:
        info["hf_config"] = hf_config
    if trainer.plan.spec.source:  # a pretrained model's folder: export copies its tokenizer files
        info["hf_source"] = trainer.plan.spec.source
    if cfg.lora_rank is not None:  # the frozen base is not saved: the folder it is read from
        info[LORA_BASE] = lora_base(trainer.plan.spec.source)
    if cfg.quantize_base:  # nor its NF4: how it is quantized again on resume
        info[QUANTIZED_BASE] = quantize.record(cfg.quantize_base, info[LORA_BASE], cfg.seed)
    companions = companion_files(trainer.plan.spec.source, cfg.tokenizer)
    if companions:
        info["companions"] = companions
    return info


def lora_base(source: str | None) -> dict | None:
    """A LoRA run's base: its folder and :func:`~fsdp2lab.models.lora.fingerprint` (None: a model
    built from the seed, which the seed rebuilds)."""
    if source is None:
        return None
    return {"folder": source, "sha256": lora.fingerprint(source)}


def check_base(trainer: Checkpointable, ckpt: Checkpoint) -> None:
    """A UsageError (the same on every rank) when a LoRA checkpoint's base folder is not this
    run's, or a training checkpoint's base quantization (none for a run without
    ``--quantize-base``) is not this run's: its adapters were trained on other weights."""
    run, cfg = saved_run(ckpt), trainer.cfg
    if OPTIM in ckpt.contents or QUANTIZED_BASE in run:  # a training run's (not imported weights)
        here = None
        if cfg.quantize_base:
            here = quantize.record(cfg.quantize_base, lora_base(trainer.plan.spec.source), cfg.seed)
        if run.get(QUANTIZED_BASE) != here:
            raise UsageError(
                f"checkpoint {ckpt.path} was trained on "
                f"{quantize.describe(run.get(QUANTIZED_BASE))}; this run has "
                f"{quantize.describe(here)}"
            )
    saved = run.get(LORA_BASE)
    if cfg.lora_rank is None or saved is None:
        return
    here = lora_base(trainer.plan.spec.source)
    if here is None or here["sha256"] != saved.get("sha256"):
        where = "a model built from the seed" if here is None else here["folder"]
        raise UsageError(
            f"checkpoint {ckpt.path} holds LoRA adapters of the base {saved.get('folder')} "
            f"(fingerprint {str(saved.get('sha256'))[:12]}), not of this run's {where}"
            + ("" if here is None else f" (fingerprint {here['sha256'][:12]})")
        )


def companion_files(source: str | None, tokenizer: str | None) -> dict[str, dict]:
    """The files ``ckpt export`` copies beside the weights, as this run found them: ``{name:
    {"folder", "sha256"}}`` for the tokenizer's files (of ``--tokenizer``, else of the pretrained
    folder) and the pretrained folder's ``generation_config.json``. Export copies a file only
    from that folder and only while its hash is the same."""
    tokenizer = tokenizer or source
    wanted = [
        (source, GENERATION_FILE),
        *((tokenizer, n) for n in TOKENIZER_FILES + TOKENIZER_EXTRAS),
    ]
    found: dict[str, dict] = {}
    for folder, name in wanted:
        file = Path(folder).resolve() / name if folder else None
        if file is not None and file.is_file():
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            found[name] = {"folder": str(file.parent), "sha256": digest}
    return found


def hf_config_of(model: torch.nn.Module) -> dict | None:
    """The model's Hugging Face config (``model.config.to_dict()``) as a dict, or None when it has
    none. Recorded in the run info, so that ``ckpt export CKPT OUT_DIR`` writes ``config.json``
    without ``--hf-config``."""
    config = getattr(model, "config", None)
    if config is None or isinstance(config, Mapping):
        settings = config
    else:
        to_dict = getattr(config, "to_dict", None)
        try:
            settings = to_dict() if callable(to_dict) else None
        except Exception:  # the model's own code: a config that cannot say itself is left out
            settings = None
    if not isinstance(settings, Mapping) or not settings.get("model_type"):
        return None  # not a Hugging Face config: export needs a model_type to build the model
    try:
        return json.loads(json.dumps(dict(settings)))
    except (TypeError, ValueError):
        return None


def marker_info(trainer: Checkpointable) -> dict:
    """What the COMPLETE mark says about a checkpoint of ``trainer`` (for ``ckpt info``)."""
    contents = FULL_CONTENTS + ([SCALER] if trainer.scaler is not None else [])
    return {**asdict(trainer.state), **run_info(trainer), "contents": contents}


def _rank_state(trainer: Checkpointable) -> dict:
    state: dict[str, Any] = {"rng_cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state(trainer.device)
    # Asking an unstarted loader for its state would start it (and draw from the RNG).
    started = getattr(trainer.loader, "_iterator", None) is not None
    state["loader"] = _loader_json(trainer.loader.state_dict()) if started else None
    return state


def _loader_json(loader_state: dict) -> str | None:
    """The loader's state dict as JSON text (plain data; torchdata's states are JSON types);
    None for a state that is not (a dataset's own objects): then resume skips its check."""
    try:
        return json.dumps(loader_state)
    except (TypeError, ValueError):
        return None


def _training_state(trainer: Checkpointable) -> dict:
    """The model's and optimizer's state dicts (the live tensors), the scheduler's, the train state."""
    options = state_dict_options(trainer.model)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=options)
    return {
        MODEL: model_sd,
        OPTIM: optim_sd,
        SCHEDULER: trainer.scheduler.state_dict(),
        TRAIN_STATE: asdict(trainer.state),
    }


def capture(trainer: Checkpointable) -> dict:
    """The state dict to save. Tensors alias the live ones: save (or stage) it before training on."""
    state = _training_state(trainer)
    state[RUN] = json.dumps(run_info(trainer))
    state[RANKS] = {str(trainer.runtime.rank): _rank_state(trainer)}
    if trainer.scaler is not None:
        state[SCALER] = trainer.scaler.state_dict()
    return state


def saved_run(ckpt: Checkpoint) -> dict:
    """The run info of a checkpoint (from its mark; imported checkpoints have only a little)."""
    return {k: v for k, v in ckpt.marker.items() if k not in ("files", "format")}


# ---------------------------------------------------------------------------- loading
def template(trainer: Checkpointable, ckpt: Checkpoint) -> dict:
    """The state dict to load into: the live tensors (DCP loads in place) and placeholders."""
    if OPTIM not in ckpt.contents:  # weights only (an imported state dict)
        return {
            MODEL: get_model_state_dict(trainer.model, options=state_dict_options(trainer.model))
        }
    state = _training_state(trainer)
    if trainer.scaler is not None and SCALER in ckpt.contents:  # else a fresh scaler starts
        state[SCALER] = trainer.scaler.state_dict()
    mine = own_rank_keys(trainer, ckpt)
    if mine:
        state[RANKS] = {str(trainer.runtime.rank): mine}
    return state


def own_rank_keys(trainer: Checkpointable, ckpt: Checkpoint) -> dict:
    """Placeholders for this rank's saved entry, where the checkpoint has one to read."""
    prefix = f"{RANKS}.{trainer.runtime.rank}."
    saved = {k[len(prefix) :] for k in ckpt.metadata.state_dict_metadata if k.startswith(prefix)}
    mine: dict[str, Any] = {}
    if "rng_cpu" in saved:
        mine["rng_cpu"] = torch.get_rng_state()
    if "rng_cuda" in saved and trainer.device.type == "cuda":
        mine["rng_cuda"] = torch.cuda.get_rng_state(trainer.device)
    if "loader" in saved:
        mine["loader"] = None
    return mine


def apply(trainer: Checkpointable, loaded: dict) -> None:
    """Put loaded model, optimizer, scheduler and train state into ``trainer``."""
    if OPTIM not in loaded:
        options = state_dict_options(trainer.model)
        set_model_state_dict(trainer.model, loaded[MODEL], options=options)
        return
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=loaded[MODEL],
        optim_state_dict=loaded[OPTIM],
        options=state_dict_options(trainer.model),
    )
    trainer.scheduler.load_state_dict(loaded[SCHEDULER])
    # The schedule owns the learning rate: the groups take the rate it last set.
    for group, lr in zip(
        trainer.optimizer.param_groups, trainer.scheduler.get_last_lr(), strict=True
    ):
        group["lr"] = lr
    trainer.state = replace(trainer.state, **loaded[TRAIN_STATE])
    if SCALER in loaded:
        trainer.scaler.load_state_dict(loaded[SCALER])


def restore_rng(trainer: Checkpointable, rank_state: dict) -> None:
    torch.set_rng_state(rank_state["rng_cpu"])
    if "rng_cuda" in rank_state:
        torch.cuda.set_rng_state(rank_state["rng_cuda"], trainer.device)


def reseed_rng(trainer: Checkpointable) -> None:
    """A deterministic fresh RNG stream per rank, for a resume where saved streams do not map."""
    seed = trainer.cfg.seed * 1_000_003 + trainer.state.step * 1000 + trainer.runtime.rank
    torch.manual_seed(seed)


def loader_position(rank_state: dict, micro_batch_global: int) -> tuple[int, int] | None:
    """(epoch, global samples into it) recorded by a rank's data loader state; None if unknown
    (no state, or one of another format: never unpickled)."""
    text = rank_state.get("loader")
    if not isinstance(text, str):
        return None
    try:
        state = json.loads(text)
    except ValueError:
        return None
    if not isinstance(state, Mapping):
        return None
    snapshot = state.get("_snapshot")  # the layout of a loader with worker processes
    if snapshot is not None:
        sampler = snapshot["_main_snapshot"]["_index_sampler_state"]
        yielded = snapshot["_snapshot_step"] + state["_steps_since_snapshot"]
    else:
        sampler, yielded = state.get("_index_sampler_state"), state.get("_num_yielded")
    if not isinstance(sampler, Mapping) or yielded is None:
        return None
    return int(sampler["epoch"]), int(sampler["start_sample"]) + int(yielded) * micro_batch_global


# ---------------------------------------------------------------------------- compatibility
def flatten(state: Mapping) -> dict[str, Any]:
    """Keys as DCP names them: nested dicts and lists holding tensors or dicts joined with dots."""
    flat: dict[str, Any] = {}

    def terminal_list(values: list) -> bool:
        return not any(
            isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and not terminal_list(v))
            for v in values
        )

    def visit(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif isinstance(value, list) and not terminal_list(value):
            for i, v in enumerate(value):
                visit((*path, str(i)), v)
        else:
            flat[".".join(path)] = value

    for key, value in state.items():
        visit((str(key),), value)
    return flat


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def check_fits(trainer: Checkpointable, ckpt: Checkpoint, state: dict) -> None:
    """A UsageError (the same on every rank) when the checkpoint does not fit this run.

    ``state`` is this rank's template without its per-rank entry. Under pipeline parallelism
    each rank holds part of the model, so the ranks pool what they found.
    """
    saved = ckpt.metadata.state_dict_metadata
    mine = flatten(state)
    missing, differ = [], []
    for key, value in mine.items():
        if key not in saved:
            missing.append(key)
            continue
        entry = saved[key]
        here = _shape(value)
        there = list(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if here != there:
            differ.append(f"{key}: {_fmt(there)} in the checkpoint, {_fmt(here)} here")
    model_keys = {k for k in mine if k.startswith(MODEL + ".")}
    report = (sorted(missing), sorted(differ), sorted(model_keys))
    reports: list = [report]
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    missing = sorted({k for r in reports for k in r[0]})
    differ = sorted({k for r in reports for k in r[1]})
    known = {k for r in reports for k in r[2]}
    extra = sorted(k for k in saved if k.startswith(MODEL + ".") and k not in known)
    if not (missing or differ or extra):
        return
    run = saved_run(ckpt)
    problems = []
    for key, ours in (("model", trainer.cfg.model), ("optimizer", trainer.cfg.optimizer)):
        theirs = run.get(key)
        if theirs is not None and theirs != ours:
            problems.append(f"it was saved with --{key} {theirs}, this run uses --{key} {ours}")
    if (run.get("scheduler") or trainer.cfg.scheduler) != trainer.cfg.scheduler:
        problems.append(
            f"it was saved with --scheduler {run['scheduler']}, this run uses "
            f"--scheduler {trainer.cfg.scheduler}"
        )
    if missing:
        problems.append(f"{len(missing)} entries of this run are not in it ({_few(missing)})")
    if extra:
        problems.append(f"{len(extra)} of its tensors are not in this model ({_few(extra)})")
    if differ:
        problems.append(f"{len(differ)} shapes differ ({_few(differ)})")
    raise UsageError(f"checkpoint {ckpt.path} does not fit this run: " + "; ".join(problems))


def _fmt(shape: list[int] | None) -> str:
    return "not a tensor" if shape is None else str(shape)


def _few(items: list[str], n: int = 3) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", and {len(items) - n} more" if len(items) > n else "")
