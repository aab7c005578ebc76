"""Time gloo's all-reduce, all-gather and reduce-scatter against the rings FSDP2 uses on CPU.

    torchrun --nproc-per-node 2 scripts/bench_gloo_collectives.py --numel 1200000 3300000

Prints, per size, the median milliseconds per call over ``--iters`` calls (after 3 warm-up calls)
of each collective on the whole world, with the ring's ratio to gloo's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp2lab.parallel.gloo_ring import ring_all_gather, ring_reduce_scatter


def _ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _time_collectives(numel: int, group: dist.ProcessGroup, iters: int) -> list[float]:
    """ms per call: all-reduce, gloo's and the ring's all-gather, gloo's and the ring's
    reduce-scatter."""
    world = group.size()
    full, shard = torch.randn(numel), torch.randn(numel // world)
    scratch = torch.randn(numel)  # gloo's calls may overwrite their input: this one
    gathered, reduced = torch.empty(numel), torch.empty(numel // world)
    return [
        _ms(lambda: dist.all_reduce(scratch), iters),
        _ms(lambda: dist.all_gather_into_tensor(gathered, shard), iters),
        _ms(lambda: ring_all_gather(gathered, shard, group), iters),
        _ms(lambda: dist.reduce_scatter_tensor(reduced, scratch), iters),
        _ms(lambda: ring_reduce_scatter(reduced, full, group), iters),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[1_200_000, 3_300_000])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD
    if dist.get_rank() == 0:
        print(f"{world} ranks; ms per call (median of {args.iters})")
        print(f"{'elements':>10s} {'all-reduce':>10s} {'AG gloo':>8s} {'AG ring':>8s} "
              f"{'RS gloo':>8s} {'RS ring':>8s}")  # fmt: skip
    for numel in args.numel:
        numel -= numel % world
        ms = _time_collectives(numel, group, args.iters)
        if dist.get_rank() == 0:
            widths = (10, 8, 8, 8, 8)
            print(
                f"{numel:10d} " + " ".join(f"{m:{w}.2f}" for m, w in zip(ms, widths, strict=True))
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
