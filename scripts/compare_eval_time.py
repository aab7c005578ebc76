"""An evaluation of the test set, its forward over whole test batches and in pieces on CPU.

One real ``Trainer`` (any ``fsdp2lab train`` flags after ``--``) evaluates, in turns, with its
forward over pieces of each size of ``--pieces`` (default: each rank's whole test batch,
``--test-batch-size``, the seed's 1000; and ``evaluation.CPU_PIECE``), ``--rounds`` times each.
Rank 0 prints the median seconds of an evaluation, the range, and what each found (correct
answers, test loss).

    torchrun --nproc-per-node 2 scripts/compare_eval_time.py -- --model cnn --dataset fashion-mnist
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.runtime import distributed, host_memory, launch_env
from fsdp2lab.training import evaluation
from fsdp2lab.training.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pieces", help="piece sizes to compare, comma-separated")
    args, train_args = parser.parse_known_args()  # the rest: `fsdp2lab train` flags
    flags = argparse.ArgumentParser()
    add_train_arguments(flags)
    cfg = config_from_args(flags.parse_args([a for a in train_args if a != "--"]))
    host_memory.configure(cfg.host_malloc)
    runtime = distributed.init(launch_env.detect(), "auto")
    try:
        trainer = Trainer(cfg, runtime)
        sizes = args.pieces or f"{cfg.test_batch_size},{evaluation.CPU_PIECE}"
        ways = {f"pieces of {n}": int(n) for n in sizes.split(",")}
        times: dict[str, list[float]] = {name: [] for name in ways}
        found = {}
        for r in range(args.rounds):
            for name in list(ways)[r % 2 :] + list(ways)[: r % 2]:
                evaluation.CPU_PIECE = ways[name]
                dist.barrier()
                start = time.perf_counter()
                ev = evaluation.evaluate(trainer)
                times[name].append(time.perf_counter() - start)
                found[name] = f"{ev['correct']}/{ev['count']} correct, loss {ev['test_loss']:.8f}"
        if runtime.is_main:
            for name, ts in times.items():
                print(
                    f"{name:14s} {statistics.median(ts):6.2f} s ({min(ts):.2f}-{max(ts):.2f})"
                    f"   {found[name]}",
                    flush=True,
                )
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
