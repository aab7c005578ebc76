"""Run under torchrun: train the variants of one world size in the same ranks, and check loaded state.

    resume_matrix.py OUT_DIR '{"name": {"flags": [...], "check": CKPT, "mutate": M, "env": {}}, ...}' COMMON...

Each variant trains as ``fsdp2lab train COMMON FLAGS --metrics-file OUT_DIR/<name>.jsonl`` (the
real session, with the hooks below added after the checkpoint hook; ``env``: fault injection
variables set for this variant only, e.g. ``FSDP2LAB_NAN_AT``). Once the checkpoint is loaded
into the running trainer (``before_fit``):

- ``mutate`` (optional) changes that trainer's state, a negative control: ``optim-row`` zeroes
  one row of one optimizer state tensor, ``data`` moves the data position one global batch on,
  ``scheduler`` steps the schedule once more, ``drop-batch`` moves data position, step count and
  a per-step schedule one step on (a run whose sampler drops the next batch: the reference of
  ``--on-nan skip``),
  ``scaler`` puts back a fresh gradient scaler's state (fp16);
- ``check`` (a checkpoint path) compares, tensor by tensor and bitwise, every parameter the
  checkpoint saves (the state dict the checkpoint code takes: a LoRA run's adapters, not its frozen
  base), every optimizer state tensor and hyperparameter (gathered to full), the scheduler, the
  train state and the gradient scaler with what the checkpoint holds, and a LoRA run's frozen base
  (gathered) with its folder's tensors (not a QLoRA run's: its NF4 base is that folder's
  rounding); each rank writes what it compared to OUT_DIR/<name>.state.rank<R>.json.
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp2lab.checkpoint.state import state_dict_options
from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.models import lora
from fsdp2lab.models.hf_weights import WeightIndex
from fsdp2lab.runtime import distributed, launch_env
from fsdp2lab.training import session
from fsdp2lab.training.hooks import Hooks

FULL = StateDictOptions(full_state_dict=True)


def config(args: list[str]):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(args))


def saved_state(ckpt: str, out: Path, name: str) -> dict:
    """The whole checkpoint as plain tensors (converted once by rank 0)."""
    flat = out / f"{name}.saved.pt"
    if dist.get_rank() == 0:
        dcp_to_torch_save(ckpt, flat)
    dist.barrier()
    return torch.load(flat, weights_only=False)


def differs(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    return a != b


def base_against_folder(trainer) -> dict[str, bool]:
    """A LoRA run's frozen base, gathered to full, against its folder's safetensors tensors:
    ``{"base.<name in the files>": differs}`` for every tensor the files hold (an upcast base,
    e.g. bf16 files in fp32, is compared with the files' tensors upcast: exact)."""
    from safetensors.torch import load_file

    folder = Path(trainer.plan.spec.source)
    files: dict[str, torch.Tensor] = {}
    for file in sorted(set(WeightIndex.read(folder).files.values())):
        files.update(load_file(folder / file))
    result = {f"base.{key}": True for key in files}  # a tensor the live model lacks differs
    for key, value in get_model_state_dict(trainer.model, options=FULL).items():
        if lora.is_adapter(key):
            continue
        value = value.full_tensor() if isinstance(value, DTensor) else value
        name = lora.base_key(key)
        folder_value = files.get(name)
        result[f"base.{name}"] = folder_value is None or differs(
            value, folder_value.to(value.dtype)
        )
    return result


class Mutate(Hooks):
    """A negative control: change the freshly loaded trainer's state in one place."""

    def __init__(self, what: str):
        self.what = what

    def before_fit(self, trainer) -> None:
        st, batch = trainer.state, trainer.plan.global_batch
        if self.what == "optim-row":
            states = trainer.optimizer.state  # a trained matrix (frozen ones have no state)
            param = next(p for p in trainer.model.parameters() if p.dim() == 2 and states.get(p))
            state = states[param]
            key = next(k for k in ("exp_avg_sq", "square_avg", "momentum_buffer") if k in state)
            local = state[key].to_local() if isinstance(state[key], DTensor) else state[key]
            if trainer.runtime.rank == 0:  # row 0 of the full tensor
                local[0].zero_()
        elif self.what in ("data", "drop-batch"):
            st.samples_seen += batch
            st.epoch_samples += batch
            if self.what == "drop-batch":
                st.step += 1
                if trainer.scheduler_unit == "step":
                    trainer.scheduler.step()
        elif self.what == "scheduler":
            trainer.scheduler.step()
        elif self.what == "scaler":
            trainer.scaler.load_state_dict(torch.amp.GradScaler(trainer.device.type).state_dict())
        else:
            raise ValueError(self.what)


class CheckLoaded(Hooks):
    """Compare the running trainer's state, as loaded, with the checkpoint's (see the docstring)."""

    def __init__(self, ckpt: str, out: Path, name: str):
        self.ckpt, self.out, self.name = ckpt, out, name

    def before_fit(self, trainer) -> None:
        saved = saved_state(self.ckpt, self.out, self.name)
        options = replace(state_dict_options(trainer.model), full_state_dict=True)
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=options)
        compared, mismatched = [], []
        for part, live in (("model", model_sd), ("optim", optim_sd)):
            for key, value in live.items():
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                compared.append(f"{part}.{key}")
                if key not in saved[part] or differs(value, saved[part][key]):
                    mismatched.append(f"{part}.{key}")
        live_parts = {
            "scheduler": trainer.scheduler.state_dict(),
            "train_state": vars(trainer.state),
        }
        if trainer.scaler is not None:
            live_parts["scaler"] = trainer.scaler.state_dict()
        for part, live in live_parts.items():
            compared.append(part)
            if part not in saved or any(differs(live.get(k), v) for k, v in saved[part].items()):
                mismatched.append(part)
        expected = [f"model.{k}" for k in saved["model"]] + [f"optim.{k}" for k in saved["optim"]]
        expected += [p for p in ("scaler",) if p in saved]
        if trainer.cfg.lora_rank is not None and not trainer.cfg.quantize_base:
            # the frozen base: not saved, read from its folder
            for key, differ in base_against_folder(trainer).items():
                compared.append(key)
                if differ:
                    mismatched.append(key)
        report = {"compared": compared, "mismatched": mismatched, "expected": expected}
        rank = trainer.runtime.rank
        (self.out / f"{self.name}.state.rank{rank}.json").write_text(json.dumps(report))


def main() -> None:
    out, variants, common = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    runtime = distributed.init(launch_env.detect(), "cpu")
    observers = session.observers
    try:
        for name, spec in variants.items():
            extra: list[Hooks] = []
            if spec.get("mutate"):
                extra.append(Mutate(spec["mutate"]))
            if spec.get("check"):
                extra.append(CheckLoaded(spec["check"], out, name))
            # The real session; these hooks run right after the checkpoint hook has loaded.
            session.observers = lambda cfg, rt, extra=extra: [*extra, *observers(cfg, rt)]
            flags = [*common, *spec["flags"], "--metrics-file", str(out / f"{name}.jsonl")]
            os.environ.update(spec.get("env", {}))
            try:
                session.run_training(config(flags), runtime)
            finally:
                for key in spec.get("env", {}):
                    del os.environ[key]
    finally:
        session.observers = observers
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
