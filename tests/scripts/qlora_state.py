"""Run under torchrun: one real QLoRA training run (``--quantize-base nf4``), watched by a hook.

    torchrun --nproc-per-node N tests/scripts/qlora_state.py OUT.json TRAIN_FLAGS...

Before training, the hook records each rank's NF4 base (the inner tensors of every quantized
weight's local shard) and every adapter (gathered to full); after training, rank 0 writes
OUT.json: per quantized weight whether it is an NF4Tensor on every rank, frozen, without gradient
or optimizer state, and bit for bit as before; per adapter whether it moved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.models import lora
from fsdp2lab.runtime import distributed, launch_env
from fsdp2lab.runtime.torch_compat import local_tensor, torchao_nf4
from fsdp2lab.training import session
from fsdp2lab.training.hooks import Hooks

NF4Tensor, _ = torchao_nf4()
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Watch(Hooks):
    def __init__(self, out: Path):
        self.out = out

    def before_fit(self, trainer) -> None:
        params = dict(trainer.model.named_parameters())
        self.base = {n: [getattr(local(p), a).clone() for a in INNER]
                     for n, p in params.items() if isinstance(local(p), NF4Tensor)}  # fmt: skip
        self.adapters = {n: full(p) for n, p in params.items() if lora.is_adapter(n)}

    def after_fit(self, trainer) -> None:
        params = dict(trainer.model.named_parameters())
        state = trainer.optimizer.state
        base = {}
        for name, before in self.base.items():
            p = params[name]
            after = [getattr(local(p), a) for a in INNER]
            base[name] = {
                "nf4": isinstance(local(p), NF4Tensor),
                "frozen": not p.requires_grad and p.grad is None and not state.get(p),
                "unchanged": all(torch.equal(x, y) for x, y in zip(before, after, strict=True)),
            }
        moved = {n: not torch.equal(before, full(params[n])) for n, before in self.adapters.items()}
        report = {"base": base, "adapters_moved": moved}
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if dist.get_rank() == 0:
            self.out.write_text(json.dumps(reports))


def main() -> None:
    out, flags = Path(sys.argv[1]), sys.argv[2:]
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(flags))
    runtime = distributed.init(launch_env.detect(), "cpu")
    observers = session.observers
    session.observers = lambda cfg, rt: [Watch(out), *observers(cfg, rt)]
    try:
        session.run_training(cfg, runtime)
    finally:
        session.observers = observers
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
