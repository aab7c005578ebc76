"""Shared-memory all-gather and reduce-scatter for FSDP2 ranks on one host (CPU, gloo).

gloo moves every byte through the loopback TCP stack: a copy into the kernel and one out, on the
same two cores that compute. Ranks on one host can instead read each other's buffers: each rank
of a process group maps every rank's slot in ``/dev/shm``, writes its input to its own slot, waits
at one gloo barrier (a few bytes: the synchronisation, and the memory ordering that comes with
it), then reads what it needs from the others' slots. Two slots per rank, used alternately, let
one barrier per collective suffice: a rank writes a slot again only two collectives later, after
every rank has passed the barrier in between, so after every rank has read it.

Where the ranks of a group cannot map each other's slots (another host, a ``/dev/shm`` too small
for a unit: the space is reserved with ``posix_fallocate``, so a full ``/dev/shm`` is an error
here, never a SIGBUS later), every rank of the group falls back to the gloo rings of
:mod:`fsdp2lab.parallel.gloo_ring`, together, and logs it once. The files are unlinked as soon as
every rank has mapped them: nothing is left in ``/dev/shm``, even after a crash.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

from fsdp2lab.parallel.gloo_ring import (
    RingAllGather,
    RingReduceScatter,
    ring_all_gather,
    ring_reduce_scatter,
)
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.torch_compat import set_custom_collectives

log = logs.get_logger(__name__)

SHM_DIR = "/dev/shm"
_ALIGN = 1 << 16  # slot sizes grow in 64 KiB steps, to the largest unit


class ShmArena:
    """Two slots per rank of ``group``, mapped by every rank of it, grown on demand.

    Every rank calls the same collectives in the same order (as for any process group), so every
    rank grows its slots, and falls back, at the same call.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=group)
        self.token: str = token[0]
        self.capacity = 0  # bytes per slot
        self.generation = 0
        self.slots: list[list[torch.Tensor]] = []  # [parity][rank], uint8
        self.calls = 0
        self.usable = True

    def _path(self, rank: int) -> str:
        return os.path.join(SHM_DIR, f"fsdp2lab-{self.token}-{self.generation}-{rank}")

    def _agree(self, ok: bool) -> bool:
        """True if ``ok`` on every rank of the group (also a barrier)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def reserve(self, nbytes: int) -> bool:
        """Slots of at least ``nbytes``; False (on every rank, for good) where they cannot be."""
        if not self.usable:
            return False
        if nbytes <= self.capacity:
            return True
        capacity = -(-nbytes // _ALIGN) * _ALIGN
        self.generation += 1
        mine, why = self._path(self.rank), ""
        try:
            fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, 2 * capacity)
            finally:
                os.close(fd)
        except OSError as e:
            why = f"{mine}: {e.strerror or e}"
        maps: list[torch.Tensor] = []
        if self._agree(not why):
            try:
                maps = [
                    torch.from_file(
                        self._path(r), shared=True, size=2 * capacity, dtype=torch.uint8
                    )
                    for r in range(self.size)
                ]
            except (OSError, RuntimeError) as e:
                why = f"another rank's buffer cannot be mapped here ({e})"
        ok = self._agree(not why)  # every rank has mapped (or failed): the files can go
        if os.path.exists(mine):
            os.unlink(mine)
        if not ok:
            self.usable = False
            self.slots = []
            if why:
                log.warning(
                    f"fsdp2lab: shared-memory collectives off for a group of {self.size} ranks "
                    f"({why}): the gloo rings run instead",
                    extra=logs.EVERY_RANK,
                )
            return False
        self.capacity = capacity
        self.slots = [[m[p * capacity : (p + 1) * capacity] for m in maps] for p in range(2)]
        return True

    def publish(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Write ``data`` (contiguous) to this rank's next slot, wait for every rank to have
        written its own, and return every rank's slot viewed like ``data`` (flat)."""
        nbytes = data.numel() * data.element_size()
        parity = self.calls % 2
        self.calls += 1
        slots = [s[:nbytes].view(data.dtype) for s in self.slots[parity]]
        slots[self.rank].copy_(data.reshape(-1))
        dist.barrier(group=self.group)
        return slots


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shm_all_gather(arena: ShmArena, output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` = the ranks' ``input`` tensors, concatenated in rank order."""
    slots = arena.publish(input)
    chunks = output.view(arena.size, -1)
    for r, slot in enumerate(slots):
        if r != arena.rank or chunks[r].data_ptr() != input.data_ptr():
            chunks[r].copy_(slot.view_as(chunks[r]))


def shm_reduce_scatter(arena: ShmArena, output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` = the sum over ranks (in rank order) of chunk ``rank`` of ``input``."""
    slots = arena.publish(input)
    n = output.numel()
    out = output.view(-1)
    lo = arena.rank * n
    torch.add(slots[0][lo : lo + n], slots[1][lo : lo + n], out=out)
    for slot in slots[2:]:
        out.add_(slot[lo : lo + n])


class _Arenas:
    """One arena per process group, made at the group's first collective."""

    def __init__(self) -> None:
        self.by_group: dict[str, ShmArena] = {}

    def get(self, group: dist.ProcessGroup) -> ShmArena:
        key = group.group_name
        if key not in self.by_group:
            self.by_group[key] = ShmArena(group)
        return self.by_group[key]


class ShmAllGather(RingAllGather):
    """FSDP2's all-gather through shared memory; the ring where the group cannot share it.

    An asynchronous request (explicit prefetch) runs at once and returns no work, which FSDP2
    treats as done: there is no transfer left to overlap.
    """

    def __init__(self, arenas: _Arenas):
        self.arenas = arenas

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        arena = self.arenas.get(group)
        if arena.reserve(_bytes(input_tensor)):
            shm_all_gather(arena, output_tensor, input_tensor)
        else:
            ring_all_gather(output_tensor, input_tensor, group)
        return None


class ShmReduceScatter(RingReduceScatter):
    """FSDP2's reduce-scatter (SUM, AVG) through shared memory; otherwise as the ring's."""

    def __init__(self, arenas: _Arenas):
        self.arenas = arenas

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        arena = self.arenas.get(group)
        if arena.reserve(_bytes(input_tensor)):
            shm_reduce_scatter(arena, output_tensor, input_tensor)
        else:
            ring_reduce_scatter(output_tensor, input_tensor, group)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())
        return None


def use_shm_collectives(model: torch.nn.Module) -> bool:
    """Give every FSDP2 module of ``model`` the shared-memory collectives (one arena per process
    group, shared by the modules); False where this torch's FSDP2 takes no custom collectives."""
    from torch.distributed.fsdp import FSDPModule

    arenas = _Arenas()
    all_gather, reduce_scatter = ShmAllGather(arenas), ShmReduceScatter(arenas)
    for module in model.modules():
        if isinstance(module, FSDPModule) and not set_custom_collectives(
            module, all_gather, reduce_scatter, name="shared-memory"
        ):
            return False
    return True
