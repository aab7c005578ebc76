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

from fsdp2lab.parallel import host_collectives, shm_collectives
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


def check_leased(name: str, g, shared: bool) -> dict:
    """Reduce-scatters whose input came from ``allocate`` (FSDP2 copies the gradients into it):
    leased in a slot and published without a copy, once the group has an arena; an all-gather
    published between the lease and the reduce-scatter does not take the leased slot; a
    lease made before the slots grow is published by copying."""
    arenas = _Arenas()
    all_gather, reduce_scatter = ShmAllGather(arenas), ShmReduceScatter(arenas)
    n, cpu, checks = g.size(), torch.device("cpu"), {}
    for i, per_rank in enumerate((40, 40, 40, 3000, 40)):
        numel = n * per_rank
        full = reduce_scatter.allocate((numel,), dtype=torch.float32, device=cpu)
        out = reduce_scatter.allocate((per_rank,), dtype=torch.float32, device=cpu)
        arena = arenas.only()
        mine = g.rank() * numel * 4  # this rank's part of a slot, for numel fp32 a rank
        ptrs = [m[mine:].data_ptr() for m in arena.slots] if arena and arena.usable else []
        leased = full.data_ptr() in ptrs
        full.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(rank + 10 * i)))
        expected = torch.empty(per_rank)
        reduce_scatter_single(expected, full.clone(), dist.ReduceOp.SUM, group=g)
        shard = torch.full((5 + i,), float(rank + i))  # the next unit's all-gather, say
        gathered, gathered_expected = torch.empty(n * (5 + i)), torch.empty(n * (5 + i))
        all_gather_single(gathered_expected, shard, group=g)
        work = all_gather(gathered, shard, g)
        if i == 3:  # slots grow (another group's arena, say) while the lease waits
            arena.reserve(2 * arena.capacity)
        reduce_scatter(out, full, g, dist.ReduceOp.SUM)
        finish(work)
        key = f"{name} n={n} leased #{i}"
        checks[key] = bool(torch.allclose(out, expected, atol=1e-5, rtol=1e-5))
        checks[f"{key} gathered"] = bool(torch.equal(gathered, gathered_expected))
        checks[f"{key} in a slot"] = leased == (shared and i > 0)
    return checks


def check_held(name: str, g, shared: bool) -> dict:
    """All-gathers whose output came from ``allocate`` (FSDP2 copies its shards into its own
    rank's part): leased in a slot, once the group has an arena, which every rank writes its
    part straight into; held through later reduce-scatters (the slots turning under them) until
    waited for; at most ``ShmArena.HELD`` at a time; one held while the slots grow stays whole."""
    arenas = _Arenas()
    all_gather, reduce_scatter = ShmAllGather(arenas), ShmReduceScatter(arenas)
    n, cpu, checks, sum_ = g.size(), torch.device("cpu"), {}, dist.ReduceOp.SUM
    reduce_scatter(torch.empty(1), torch.zeros(n), g, sum_)  # the group's first: its arena
    arena = arenas.only()
    for batch in (((0, 30), (1, 30), (2, 30)), ((3, 30), (4, 2000)), ((5, 30),)):
        pending = []
        for i, per_rank in batch:
            out = all_gather.allocate((n * per_rank,), dtype=torch.float32, device=cpu)
            slots = arena.slots if arena.usable else []
            in_slot = any(out.data_ptr() == m.data_ptr() for m in slots)
            shard = torch.randn(per_rank, generator=torch.Generator().manual_seed(rank + 10 * i))
            expected = torch.empty(n * per_rank)
            all_gather_single(expected, shard, group=g)
            own = out.view(n, -1)[g.rank()]
            own.copy_(shard)
            pending.append((i, all_gather(out, own, g), out, expected, in_slot))
            summed = []
            for j in range(3):  # each passes a barrier; their leased inputs take free slots
                full = reduce_scatter.allocate((n * per_rank,), dtype=torch.float32, device=cpu)
                full.fill_(g.rank() + j)
                reduced = torch.empty(per_rank)
                reduce_scatter(reduced, full, g, sum_)
                summed.append(bool(torch.all(reduced == sum(range(n)) + n * j)))
            checks[f"{name} n={n} held #{i} reduce-scatters"] = all(summed)
        for i, work, out, expected, in_slot in pending:
            finish(work)
            checks[f"{name} n={n} held #{i} gathered"] = bool(torch.equal(out, expected))
            third = i == 2  # a third held at once: plain memory instead
            checks[f"{name} n={n} held #{i} in a slot"] = in_slot == (shared and not third)
    checks[f"{name} n={n} held released"] = not arena.held
    return checks


def check_host(name: str, g) -> dict:
    """``host_collectives``' all-gather and all-reduce (SUM, MAX, MIN) of small CPU tensors
    against gloo's: a flag pair, a float64 row, a growing tensor, in turn (shared slots reused)."""
    n, checks = g.size(), {}
    for i, (numel, dtype) in enumerate(
        ((2, torch.float32), (9, torch.float64), (20000, torch.float32), (2, torch.float32))
    ):
        gen = torch.Generator().manual_seed(100 * rank + i)
        t = torch.randn(numel, generator=gen).to(dtype)
        key = f"{name} n={n} host numel={numel} {dtype} #{i}"
        expected = torch.empty(n * numel, dtype=dtype)
        all_gather_single(expected, t, group=g)
        checks[f"ag {key}"] = bool(
            torch.equal(host_collectives.all_gather(t, g), expected.view(n, -1))
        )
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            ours, theirs = t.clone(), t.clone()
            host_collectives.all_reduce(ours, op, g)
            dist.all_reduce(theirs, op, group=g)
            checks[f"ar {op} {key}"] = bool(torch.allclose(ours, theirs, atol=1e-6, rtol=1e-6))
    return checks


def fsdp2_barriers_per_step() -> tuple[int, int]:
    """Barriers one FSDP2 step passes with shared memory, one unit per layer of 4 (the last
    one kept gathered for backward) plus the root: 5 in forward (the root's and 4 units'
    all-gathers, each waited for at once) and 5 in backward (5 reduce-scatters, each also
    serving the all-gather FSDP2 prefetched before it), where each collective alone would pass
    13; and how many inputs were published without a copy (the 5 reduce-scatters' inputs and
    the 8 all-gathers' own parts of their outputs)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2lab.parallel.fsdp2 import apply_fsdp

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), *layers, torch.nn.Linear(16, 2))
    mesh = init_device_mesh("cpu", (world,))
    apply_fsdp(model, mesh, layers, unit_policy="layer", gloo_collectives="shm")
    arena_type = shm_collectives.ShmArena
    barrier, publish = arena_type._barrier, arena_type.publish
    barriers, in_place = [], []

    def counting(arena):
        barriers[-1] += 1
        return barrier(arena)

    def publishing(arena, data, read):
        leased = arena.leased is not None
        call = publish(arena, data, read)
        in_place[-1] += leased and arena.leased is None  # the lease was this input
        return call

    arena_type._barrier, arena_type.publish = counting, publishing
    for _ in range(3):
        barriers.append(0)
        in_place.append(0)
        model(torch.randn(4, 8)).sum().backward()
    arena_type._barrier, arena_type.publish = barrier, publish
    return barriers[-1], in_place[-1]


checks, usable, barriers_used = {}, {}, {}
for g in groups:
    checks.update(check("ring", RingAllGather(), RingReduceScatter(), g))
    # The barrier on shared counts (x86-64), and gloo's (elsewhere).
    native = shm_collectives.SHM_BARRIER
    for name, shm_barrier in (("shm", native), ("shm-gloo-barrier", False)):
        shm_collectives.SHM_BARRIER = shm_barrier
        arenas = _Arenas()
        checks.update(check(name, ShmAllGather(arenas), ShmReduceScatter(arenas), g))
        checks.update(check_deferred(name, ShmAllGather(arenas), ShmReduceScatter(arenas), g))
        checks.update(check_leased(name, g, shared=True))
        checks.update(check_held(name, g, shared=True))
        host_collectives._ARENAS.clear()
        checks.update(check_host(name, g))
        usable[f"n={g.size()} {name}"] = arenas.get(g).usable
        barriers_used[name] = arenas.get(g).shm_barrier is not None
        shm_collectives.SHM_BARRIER = native
    # Rank 1's /dev/shm is unusable: every rank of its groups falls back to the rings.
    if rank == 1:
        shm_collectives.SHM_DIR = "/nonexistent-shm"
    arenas = _Arenas()
    checks.update(check("shm-fallback", ShmAllGather(arenas), ShmReduceScatter(arenas), g))
    shared = 1 not in dist.get_process_group_ranks(g)
    checks.update(check_leased("shm-fallback", g, shared=shared))
    checks.update(check_held("shm-fallback", g, shared=shared))
    host_collectives._ARENAS.clear()
    checks.update(check_host("shm-fallback", g))
    usable[f"n={g.size()} host, rank 1 without /dev/shm"] = host_collectives._arena(g).usable
    usable[f"n={g.size()} rank 1 without /dev/shm"] = arenas.get(g).usable
    shm_collectives.SHM_DIR = "/dev/shm"
barriers, in_place = fsdp2_barriers_per_step()
dist.barrier()
left = sorted(ours_in_dev_shm() - before)
report = {"rank": rank, "checks": checks, "usable": usable, "left_in_dev_shm": left}
report["shm_barrier"] = barriers_used | {"native": shm_collectives.SHM_BARRIER}
# None where this torch's FSDP2 takes no custom collectives (gloo's own run)
report["fsdp2_barriers_per_step"] = barriers if AllGatherBase is not object else None
report["fsdp2_published_in_place_per_step"] = in_place if AllGatherBase is not object else None
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
distributed.exit_process(0)
