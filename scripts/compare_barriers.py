"""Paired timing of the shared-memory collectives' barrier (counts in /dev/shm) against gloo's.

Each rank computes ``--work-ms`` (a matrix product loop: the part of a step between two
collectives), then passes a barrier; rounds alternate the two barriers, so load from other jobs
falls on both. Prints, per barrier, the median time a loop takes beyond the work (the barrier's
cost, the last rank's lateness included) over rounds, with its range.

    torchrun --nproc-per-node 2 scripts/compare_barriers.py --rounds 10 --loops 50 --work-ms 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp2lab.parallel.shm_collectives import SHM_BARRIER, ShmArena
from fsdp2lab.runtime import distributed


def work(ms: float, a: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a @ a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--loops", type=int, default=50, help="work + barrier per round")
    parser.add_argument("--work-ms", type=float, default=3.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if not SHM_BARRIER:
        raise SystemExit("the shared-memory barrier runs on x86-64 only (gloo's elsewhere)")
    arena = ShmArena(dist.group.WORLD)
    assert arena.reserve(1 << 16), "no shared memory here"
    shm = arena.shm_barrier
    a = torch.randn(128, 128)
    costs: dict[str, list[float]] = {"shared memory": [], "gloo": []}
    for r in range(args.rounds):
        for name in list(costs)[r % 2 :] + list(costs)[: r % 2]:
            arena.shm_barrier = shm if name == "shared memory" else None
            arena._barrier()
            start = time.perf_counter()
            for _ in range(args.loops):
                work(args.work_ms, a)
                arena._barrier()
            elapsed_ms = (time.perf_counter() - start) * 1000 / args.loops
            costs[name].append(elapsed_ms - args.work_ms)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {args.work_ms} ms of work between barriers:")
        for name, ms in costs.items():
            print(f"  {name:14s} {statistics.median(ms):.3f} ms ({min(ms):.3f}-{max(ms):.3f})")
    distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
