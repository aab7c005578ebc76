"""Small collectives of CPU tensors (flags, a step's numbers) through shared memory where the
ranks of a group share a host; elsewhere (GPU tensors, ranks on several hosts) the group's own.

gloo moves even a few bytes through loopback TCP and its own threads, on the cores that train:
the NaN guard's all-reduce of two flags after every step, and the step record's gather, cost the
main job more than their own time (docs/speed.md, round 6). Here a rank writes its tensor to a
slot of an arena of its own (:class:`~fsdp2lab.parallel.shm_collectives.ShmArena`: its own files
and barrier, apart from FSDP2's), passes one barrier and reads every rank's: an all-reduce is an
all-gather reduced in rank order, so every rank gets the same bits. Every rank calls these in the
same order, as for any collective; the first call on a group maps its arena (falling back,
together, where the ranks cannot share one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp2lab.parallel.shm_collectives import ShmArena, shm_all_gather
from fsdp2lab.runtime.torch_compat import all_gather_single

_REDUCE = {
    dist.ReduceOp.SUM: torch.sum,
    dist.ReduceOp.MAX: torch.amax,
    dist.ReduceOp.MIN: torch.amin,
}
# id(group) -> (group, its arena): a group made again at the same address gets a new arena.
_ARENAS: dict[int, tuple[dist.ProcessGroup, ShmArena]] = {}


def _arena(group: dist.ProcessGroup) -> ShmArena:
    entry = _ARENAS.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _ARENAS[id(group)] = (group, ShmArena(group))
    return entry[1]


def shares_memory(group: dist.ProcessGroup | None = None) -> bool:
    """Whether the group's CPU tensors go through shared memory here (several ranks, gloo, one
    host). A collective where the group has no arena yet: every rank asks, at the same point."""
    group = group or dist.group.WORLD
    return group.size() > 1 and dist.get_backend(group) == "gloo" and _arena(group).reserve(1)


def all_gather(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``t``, flattened, as the rows of a (ranks, numel) tensor in rank order."""
    group = group or dist.group.WORLD
    flat = t.detach().reshape(-1).contiguous()
    rows = torch.empty(group.size(), flat.numel(), dtype=flat.dtype, device=flat.device)
    if group.size() == 1:
        rows[0] = flat
        return rows
    if flat.device.type == "cpu" and dist.get_backend(group) == "gloo":
        arena = _arena(group)
        if arena.reserve(flat.numel() * flat.element_size()):
            shm_all_gather(arena, rows.view(-1), flat)
            arena.sync()
            return rows
    all_gather_single(rows.view(-1), flat, group=group)
    return rows


def all_reduce(
    t: torch.Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``dist.all_reduce(t, op)`` (SUM, MAX or MIN) in place; returns ``t``. A CPU tensor is
    gathered and reduced in rank order (the same bits on every rank)."""
    if t.device.type != "cpu":
        dist.all_reduce(t, op=op, group=group)
        return t
    reduced = _REDUCE[op](all_gather(t, group), dim=0)
    return t.copy_(reduced.view_as(t))
