"""The gradient norm of a step, as ``parallel/grad_norm.py`` takes it and on the DTensors.

One real ``Trainer`` (any ``fsdp2lab train`` flags after ``--``) takes a step; then, in turns,
each way of taking the norm of its gradients runs ``--calls`` times: ``total_grad_norm`` (for
plain FSDP, the local shards' squares summed over the mesh's group) and the DTensor path
(``get_total_norm`` on the DTensors, then ``full_tensor``). Rank 0 prints both norms and the
median milliseconds of a call.

    torchrun --nproc-per-node 2 scripts/compare_grad_norm.py -- --model cnn --dataset synthetic
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.parallel.grad_norm import total_grad_norm
from fsdp2lab.runtime import distributed, host_memory, launch_env
from fsdp2lab.training.trainer import Trainer


def _dtensor_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per way and round")
    args, train_args = parser.parse_known_args()  # the rest: `fsdp2lab train` flags
    flags = argparse.ArgumentParser()
    add_train_arguments(flags)
    cfg = config_from_args(flags.parse_args([a for a in train_args if a != "--"]))
    host_memory.configure("cached")
    runtime = distributed.init(launch_env.detect(), "auto")
    try:
        trainer = Trainer(cfg, runtime)
        trainer.sampler.set_epoch(1, 0)
        trainer.train_step(iter(trainer.loader))
        params = list(trainer.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        ways = {
            "grad_norm.py": lambda: total_grad_norm(params),
            "DTensor": lambda: _dtensor_norm(grads),
        }
        norms = {name: float(way()) for name, way in ways.items()}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in list(ways)[r % 2 :] + list(ways)[: r % 2]:
                calls = []
                for _ in range(args.calls):
                    dist.barrier()
                    start = time.perf_counter()
                    ways[name]()
                    calls.append(time.perf_counter() - start)
                times[name].append(statistics.median(calls) * 1000)
        if runtime.is_main:
            print(f"{runtime.world_size} ranks, {cfg.strategy}, {len(grads)} gradients:")
            for name, ms in times.items():
                print(
                    f"  {name:13s} norm {norms[name]:.9g}  {statistics.median(ms):.3f} ms a call "
                    f"({min(ms):.3f}-{max(ms):.3f})"
                )
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
