"""Run under torchrun: train the variants of one world size in the same ranks, and check loaded state.

    resume_matrix.py OUT_DIR '{"name": {"flags": [...], "check": "CKPT" | null}, ...}' COMMON...

Each variant trains as ``fsdp2lab train COMMON FLAGS --metrics-file OUT_DIR/<name>.jsonl``. A variant
with ``check`` first loads that checkpoint into a fresh trainer of its layout and compares, tensor
by tensor and bitwise, every parameter, every optimizer state tensor and hyperparameter (gathered
to full), the scheduler and the train state with what the checkpoint holds; each rank writes what
it compared to OUT_DIR/<name>.state.rank<R>.json.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.runtime import distributed, launch_env
from fsdp2lab.training.checkpointing import CheckpointManager
from fsdp2lab.training.session import run_training
from fsdp2lab.training.trainer import Trainer

FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


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


def check_loaded_state(cfg, runtime, ckpt: str, out: Path, name: str) -> None:
    saved = saved_state(ckpt, out, name)
    manager = CheckpointManager(cfg, runtime)
    trainer = Trainer(cfg, runtime, hooks=[manager])
    manager.before_fit(trainer)  # loads ckpt: DCP reshards to this layout
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=FULL)
    compared, mismatched = [], []
    for part, live in (("model", model_sd), ("optim", optim_sd)):
        for key, value in live.items():
            if isinstance(value, torch.distributed.tensor.DTensor):
                value = value.full_tensor()
            compared.append(f"{part}.{key}")
            if key not in saved[part] or differs(value, saved[part][key]):
                mismatched.append(f"{part}.{key}")
    for part, live in (("scheduler", trainer.scheduler.state_dict()), ("train_state", None)):
        live = live if live is not None else vars(trainer.state)
        compared.append(part)
        if any(differs(live.get(k), v) for k, v in saved[part].items()):
            mismatched.append(part)
    expected = [f"model.{k}" for k in saved["model"]] + [f"optim.{k}" for k in saved["optim"]]
    report = {"compared": compared, "mismatched": mismatched, "expected": expected}
    (out / f"{name}.state.rank{runtime.rank}.json").write_text(json.dumps(report))


def main() -> None:
    out, variants, common = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    runtime = distributed.init(launch_env.detect(), "cpu")
    try:
        for name, spec in variants.items():
            flags = [*common, *spec["flags"]]
            if spec.get("check"):
                check_loaded_state(config(flags), runtime, spec["check"], out, name)
            run_training(config([*flags, "--metrics-file", str(out / f"{name}.jsonl")]), runtime)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
