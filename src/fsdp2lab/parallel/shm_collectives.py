"""Shared-memory all-gather and reduce-scatter for FSDP2 ranks on one host (CPU, gloo).

gloo moves every byte through the loopback TCP stack: a copy into the kernel and one out, on the
same two cores that compute. Ranks on one host can instead read each other's buffers: each rank
of a process group maps every rank's slots in ``/dev/shm``, writes its input to a slot of its own,
waits at a gloo barrier (a few bytes: the synchronisation, and the memory ordering that comes with
it), then reads what it needs from the others' slots.

On 2 cores the barriers, not the bytes, are the cost: each waits until every rank has been
scheduled. So an all-gather only publishes its input, and reads at the group's next barrier,
which its work's ``wait`` passes if no later collective has. In backward FSDP2 issues the next
unit's all-gather (its prefetch) before this unit's reduce-scatter, whose barrier serves both.
A rank writes a slot again only once every rank has read it: the slot was read before the
latest barrier. Four slots per rank cover the steady state without extra barriers. All of this
rests on every rank of a group calling its collectives, and waiting for them, in the same
order, which FSDP2 does.

Where the ranks of a group cannot map each other's slots (another host, a ``/dev/shm`` too small
for a unit: the space is reserved with ``posix_fallocate``, so a full ``/dev/shm`` is an error
here, never a SIGBUS later), every rank of the group falls back to the gloo rings of
:mod:`fsdp2lab.parallel.gloo_ring`, together, and logs it once. The files are unlinked as soon as
every rank has mapped them: nothing is left in ``/dev/shm``, even after a crash.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

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
    """``SLOTS`` slots per rank of ``group``, mapped by every rank of it, grown on demand.

    Every rank calls the same collectives in the same order (as for any process group), so every
    rank grows its slots, falls back, picks a slot and passes a barrier at the same call.
    """

    SLOTS = 4  # enough for a step's steady state: an all-gather and a reduce-scatter per barrier

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=group)
        self.token: str = token[0]
        self.capacity = 0  # bytes per slot
        self.generation = 0
        self.slots: list[list[torch.Tensor]] = []  # [slot][rank], uint8
        self.usable = True
        self.barriers = 0
        self.read_at = [-1] * self.SLOTS  # the barrier count when each slot was last read
        self.calls = 0
        self.pending: dict[int, tuple[int, Callable[[], None]]] = {}  # call: (slot, read)

    def _path(self, rank: int) -> str:
        return os.path.join(SHM_DIR, f"fsdp2lab-{self.token}-{self.generation}-{rank}")

    def _agree(self, ok: bool) -> bool:
        """True if ``ok`` on every rank of the group."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def reserve(self, nbytes: int) -> bool:
        """Slots of at least ``nbytes``; False (on every rank, for good) where they cannot be.

        Collectives still pending keep the old slots mapped until they are read.
        """
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
                os.posix_fallocate(fd, 0, self.SLOTS * capacity)
            finally:
                os.close(fd)
        except OSError as e:
            why = f"{mine}: {e.strerror or e}"
        maps: list[torch.Tensor] = []
        if self._agree(not why):
            try:
                maps = [
                    torch.from_file(
                        self._path(r), shared=True, size=self.SLOTS * capacity, dtype=torch.uint8
                    )
                    for r in range(self.size)
                ]
            except (OSError, RuntimeError) as e:
                why = f"another rank's buffer cannot be mapped here ({e})"
        ok = self._agree(not why)  # every rank has mapped (or failed): the files can go
        if os.path.exists(mine):
            os.unlink(mine)
        if not ok:
            self.sync()  # what is pending was published in the old slots, which still work
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
        self.slots = [
            [m[s * capacity : (s + 1) * capacity] for m in maps] for s in range(self.SLOTS)
        ]
        self.read_at = [-1] * self.SLOTS
        self.pending = {call: (-1, read) for call, (_, read) in self.pending.items()}
        return True

    def _free_slot(self) -> int:
        """A slot no collective is pending in, and that every rank has read since it was last
        written: read before the latest barrier."""
        while True:
            busy = {slot for slot, _ in self.pending.values()}
            for s in range(self.SLOTS):
                if s not in busy and self.read_at[s] < self.barriers:
                    return s
            if self.pending:
                self.sync()
            else:
                self._barrier()

    def _barrier(self) -> None:
        dist.barrier(group=self.group)
        self.barriers += 1

    def publish(self, data: torch.Tensor, read: Callable[[list[torch.Tensor]], None]) -> int:
        """Write ``data`` (contiguous) to a slot of this rank; once every rank has written its
        own (at the next :meth:`sync`), ``read`` gets every rank's slot viewed like ``data``
        (flat). Returns the call's number, for :meth:`done`."""
        s = self._free_slot()
        slots = [m[: _bytes(data)].view(data.dtype) for m in self.slots[s]]
        slots[self.rank].copy_(data.reshape(-1))
        self.calls += 1
        self.pending[self.calls] = (s, lambda: read(slots))
        return self.calls

    def sync(self) -> None:
        """One barrier, after which every pending collective reads its slots."""
        self._barrier()
        for s, read in self.pending.values():
            read()
            if s >= 0:
                self.read_at[s] = self.barriers
        self.pending.clear()

    def done(self, call: int) -> bool:
        return call not in self.pending


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shm_all_gather(arena: ShmArena, output: torch.Tensor, input: torch.Tensor) -> int:
    """``output`` = the ranks' ``input`` tensors, concatenated in rank order, once the returned
    call is done (at the group's next barrier)."""

    def read(slots: list[torch.Tensor]) -> None:
        chunks = output.view(arena.size, -1)
        for r, slot in enumerate(slots):
            if r != arena.rank or chunks[r].data_ptr() != input.data_ptr():
                chunks[r].copy_(slot.view_as(chunks[r]))

    return arena.publish(input, read)


def shm_reduce_scatter(arena: ShmArena, output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` = the sum over ranks (in rank order) of chunk ``rank`` of ``input``."""
    n = output.numel()
    lo = arena.rank * n

    def read(slots: list[torch.Tensor]) -> None:
        out = output.view(-1)
        torch.add(slots[0][lo : lo + n], slots[1][lo : lo + n], out=out)
        for slot in slots[2:]:
            out.add_(slot[lo : lo + n])

    arena.publish(input, read)
    arena.sync()


class ShmWork(dist.Work):
    """An all-gather published to the slots; :meth:`wait` passes the barrier if no later
    collective of the group has yet."""

    def __init__(self, arena: ShmArena, call: int):
        super().__init__()
        self.arena, self.call = arena, call

    def is_completed(self) -> bool:
        return self.arena.done(self.call)

    def wait(self, timeout=None) -> bool:
        if not self.arena.done(self.call):
            self.arena.sync()
        return True


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

    Every all-gather returns work, asynchronous or not: FSDP2 waits for it before it reads the
    output, so the barrier can wait until then, or until a later collective of the group passes
    one. A prefetched all-gather thus shares the barrier of the reduce-scatter issued before
    the unit runs (an all-gather per block in backward) instead of passing its own.
    """

    def __init__(self, arenas: _Arenas):
        self.arenas = arenas

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        arena = self.arenas.get(group)
        if arena.reserve(_bytes(input_tensor)):
            return ShmWork(arena, shm_all_gather(arena, output_tensor, input_tensor))
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
