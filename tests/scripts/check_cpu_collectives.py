"""Compare the CPU collectives FSDP2 uses (the gloo rings, the shared-memory ones) with gloo's own;
each rank writes its checks to OUT/rank-R.json.

Run under torchrun with 2 or 4 ranks; with 4 it also checks the 2-rank subgroups of a 2 x 2 mesh
(the HSDP shard groups). The shared-memory collectives run twice: as they are, then with rank 1's
``/dev/shm`` unusable, where every rank of the group must fall back to the rings together.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2lab.parallel import shm_collectives
from fsdp2lab.parallel.gloo_ring import RingAllGather, RingReduceScatter
from fsdp2lab.parallel.shm_collectives import ShmAllGather, ShmReduceScatter, _Arenas
from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.torch_compat import AllGatherBase, all_gather_single, reduce_scatter_single


def ours_in_dev_shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("fsdp2lab-")}


before = ours_in_dev_shm()  # another job's, or a killed run's: not this run's to answer for
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
groups = [dist.group.WORLD]
if world == 4:
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups.append(shard_groups[rank // 2])
SIZES = ((7, torch.float32), (1001, torch.float32), (64, torch.bfloat16), (1003, torch.float32))


def check(name: str, all_gather, reduce_scatter, g) -> dict:
    """Each size twice (both slots of the shared-memory arena; growing, then reusing them)."""
    checks = {}
    n = g.size()
    for repeat in range(2):
        for per_rank, dtype in SIZES:
            numel = n * per_rank
            gen = torch.Generator().manual_seed(1000 * rank + numel + repeat)
            full = torch.randn(numel, generator=gen).to(dtype)
            shard = full[: numel // n].clone()
            key = f"{name} n={n} numel={numel} {dtype} #{repeat}"
            # all-gather: identical bytes (also where the input is the output's own chunk, as
            # FSDP2 passes it)
            ours, theirs = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            finish(all_gather(ours, shard, g))
            all_gather_single(theirs, shard, group=g)
            checks[f"ag {key}"] = bool(torch.equal(ours, theirs))
            inplace = torch.empty(numel, dtype=dtype)
            own = inplace.view(n, -1)[g.rank()]
            own.copy_(shard)
            finish(all_gather(inplace, own, g))
            checks[f"ag in place {key}"] = bool(torch.equal(inplace, theirs))
            # reduce-scatter, SUM and AVG: equal up to the order of the additions
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                ours = torch.empty(numel // n, dtype=dtype)
                theirs = torch.empty(numel // n, dtype=dtype)
                before = full.clone()
                reduce_scatter(ours, full, g, op)
                assert torch.equal(full, before), "the input was modified"
                reduce_scatter_single(theirs, full.clone(), dist.ReduceOp.SUM, group=g)
                if op == dist.ReduceOp.AVG:
                    theirs /= n
                # each of the n - 1 additions rounds once, in its own order
                tol = n * 2**-8 if dtype == torch.bfloat16 else 1e-5
                checks[f"rs {op} {key}"] = bool(
                    torch.allclose(ours.float(), theirs.float(), atol=tol, rtol=tol)
                )
    return checks


def finish(work) -> None:
    if work is not None:
        work.wait()


def check_deferred(name: str, all_gather, reduce_scatter, g) -> dict:
    """All-gathers waited for late, out of order, across reduce-scatters, more of them pending
    than the arena has slots, each input changed after the call: every output is still what
    gloo gathers from the inputs as they were at the call."""
    n = g.size()
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(n * (50 + 7 * i), generator=gen) for i in range(8)]
    pending = []
    for i, full in enumerate(inputs):
        shard = full[: full.numel() // n].clone()
        expected = torch.empty_like(full)
        all_gather_single(expected, shard, group=g)
        out = torch.empty_like(full)
        pending.append((all_gather(out, shard, g), out, expected))
        shard.fill_(float("nan"))
        if i == 2:  # a reduce-scatter between, which passes a barrier at once
            rs_out, rs_expected = torch.empty(full.numel() // n), torch.empty(full.numel() // n)
            reduce_scatter(rs_out, full, g, dist.ReduceOp.SUM)
            reduce_scatter_single(rs_expected, full.clone(), dist.ReduceOp.SUM, group=g)
            ok = torch.allclose(rs_out, rs_expected, atol=1e-5, rtol=1e-5)
            pending.append((None, ok, True))
    checks = {}
    for i, (work, out, expected) in enumerate(reversed(pending)):
        finish(work)
        same = out if isinstance(out, bool) else bool(torch.equal(out, expected))
        checks[f"{name} n={n} deferred #{i}"] = same
    return checks


def fsdp2_barriers_per_step() -> int:
    """Barriers one FSDP2 step passes with shared memory, one unit per layer of 4 (the last
    one kept gathered for backward) plus the root: 5 in forward (the root's and 4 units'
    all-gathers, each waited for at once) and 5 in backward (5 reduce-scatters, each also
    serving the all-gather FSDP2 prefetched before it), where each collective alone would pass
    13."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2lab.parallel.fsdp2 import apply_fsdp

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), *layers, torch.nn.Linear(16, 2))
    mesh = init_device_mesh("cpu", (world,))
    apply_fsdp(model, mesh, layers, unit_policy="layer", gloo_collectives="shm")
    counts, barrier = [], dist.barrier

    def counting(*args, **kwargs):
        counts[-1] += 1
        return barrier(*args, **kwargs)

    dist.barrier = counting
    for _ in range(3):
        counts.append(0)
        model(torch.randn(4, 8)).sum().backward()
    dist.barrier = barrier
    return counts[-1]


checks, usable = {}, {}
for g in groups:
    checks.update(check("ring", RingAllGather(), RingReduceScatter(), g))
    arenas = _Arenas()
    checks.update(check("shm", ShmAllGather(arenas), ShmReduceScatter(arenas), g))
    checks.update(check_deferred("shm", ShmAllGather(arenas), ShmReduceScatter(arenas), g))
    usable[f"n={g.size()}"] = arenas.get(g).usable
    # Rank 1's /dev/shm is unusable: every rank of its groups falls back to the rings.
    if rank == 1:
        shm_collectives.SHM_DIR = "/nonexistent-shm"
    arenas = _Arenas()
    checks.update(check("shm-fallback", ShmAllGather(arenas), ShmReduceScatter(arenas), g))
    usable[f"n={g.size()} rank 1 without /dev/shm"] = arenas.get(g).usable
    shm_collectives.SHM_DIR = "/dev/shm"
barriers = fsdp2_barriers_per_step()
dist.barrier()
left = sorted(ours_in_dev_shm() - before)
report = {"rank": rank, "checks": checks, "usable": usable, "left_in_dev_shm": left}
# None where this torch's FSDP2 takes no custom collectives (gloo's own run)
report["fsdp2_barriers_per_step"] = barriers if AllGatherBase is not object else None
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
distributed.exit_process(0)
