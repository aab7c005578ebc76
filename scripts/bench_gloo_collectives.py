"""Time gloo's all-reduce, all-gather and reduce-scatter against the rings and the shared-memory
collectives FSDP2 uses on CPU.

    torchrun --nproc-per-node 2 scripts/bench_gloo_collectives.py --numel 1200000 3300000

Prints, per size, the median milliseconds per call over ``--iters`` calls (after 3 warm-up calls)
of each collective on the whole world ("shm": :mod:`fsdp2lab.parallel.shm_collectives`, the
default for ranks on one host). The last column asks whether a reduce-scatter left in
flight while compute goes on (what CUDA streams give FSDP2 on GPU) would be cheaper on CPU: every
chunk's send and receive posted at once (gloo's transport threads move them), a fixed piece of
compute, then the wait and the sum; the median of that less the median of the compute alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp2lab.parallel.gloo_ring import ring_all_gather, ring_reduce_scatter
from fsdp2lab.parallel.shm_collectives import ShmArena, shm_all_gather, shm_reduce_scatter
from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.torch_compat import all_gather_single, reduce_scatter_single


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
    """ms per call: all-reduce, gloo's, the ring's and shm's all-gather, gloo's, the ring's and
    shm's reduce-scatter; then the overlapped reduce-scatter's exposed ms."""
    world = group.size()
    arena = ShmArena(group)
    assert arena.reserve(numel * 4), "no shared memory here"
    full, shard = torch.randn(numel), torch.randn(numel // world)
    scratch = torch.randn(numel)  # gloo's calls may overwrite their input: this one
    gathered, reduced = torch.empty(numel), torch.empty(numel // world)
    return [
        _ms(lambda: dist.all_reduce(scratch), iters),
        _ms(lambda: all_gather_single(gathered, shard), iters),
        _ms(lambda: ring_all_gather(gathered, shard, group), iters),
        _ms(lambda: shm_all_gather(arena, gathered, shard), iters),
        _ms(lambda: reduce_scatter_single(reduced, scratch), iters),
        _ms(lambda: ring_reduce_scatter(reduced, full, group), iters),
        _ms(lambda: shm_reduce_scatter(arena, reduced, full), iters),
        _ms(lambda: _overlapped(reduced, full, group), iters) - _ms(_compute, iters),
    ]


_A, _B = torch.randn(256, 256), torch.randn(256, 256)


def _compute() -> None:
    for _ in range(100):  # ~30-50 ms on one core here
        _A @ _B


def _overlapped(reduced: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    size, rank = group.size(), group.rank()
    chunks, received = full.view(size, -1), torch.empty(size, full.numel() // size)
    ops = []
    for k in range(1, size):
        to, frm = (rank + k) % size, (rank - k) % size
        ops.append(dist.P2POp(dist.isend, chunks[to], group=group, group_peer=to))
        ops.append(dist.P2POp(dist.irecv, received[frm], group=group, group_peer=frm))
    works = dist.batch_isend_irecv(ops)
    _compute()
    for work in works:
        work.wait()
    received[rank] = chunks[rank]
    torch.sum(received, dim=0, out=reduced)


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
              f"{'AG shm':>8s} {'RS gloo':>8s} {'RS ring':>8s} {'RS shm':>8s} "
              f"{'RS overlapped, exposed':>23s}")  # fmt: skip
    for numel in args.numel:
        numel -= numel % world
        ms = _time_collectives(numel, group, args.iters)
        if dist.get_rank() == 0:
            widths = (10, 8, 8, 8, 8, 8, 8, 23)
            print(
                f"{numel:10d} " + " ".join(f"{m:{w}.2f}" for m, w in zip(ms, widths, strict=True))
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
