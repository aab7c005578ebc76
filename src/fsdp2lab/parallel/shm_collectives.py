"""Shared-memory all-gather and reduce-scatter for FSDP2 ranks on one host (CPU, gloo).

gloo moves every byte through the loopback TCP stack: a copy into the kernel and one out, on the
same two cores that compute. Ranks on one host can instead read each other's buffers: the ranks
of a process group map one file in ``/dev/shm`` (its slots), each writes its input to its own
part of a slot, waits at a barrier (:class:`ShmBarrier`, counts in the same file, on x86-64;
gloo's elsewhere), then reads what it needs from the others' parts. FSDP2's all-gather output is
itself a slot, so its shards are written once, by FSDP2, and read once, by FSDP2's copy-out.

On 2 cores the barriers, not the bytes, are the cost: each waits until every rank has been
scheduled. So an all-gather only publishes its input, and reads at the group's next barrier,
which its work's ``wait`` passes if no later collective has. In backward FSDP2 issues the next
unit's all-gather (its prefetch) before this unit's reduce-scatter, whose barrier serves both.
A rank writes a slot again only once every rank has read it: the slot was read before the
latest barrier. Four slots cover the steady state without extra barriers. All of this rests on
every rank of a group calling its collectives, and waiting for them, in the same order, which
FSDP2 does.

Where the ranks of a group cannot map the slots (another host, a ``/dev/shm`` too small
for a unit: the space is reserved with ``posix_fallocate``, so a full ``/dev/shm`` is an error
here, never a SIGBUS later), every rank of the group falls back to the gloo rings of
:mod:`fsdp2lab.parallel.gloo_ring`, together, and logs it once. The file is unlinked as soon as
every rank has mapped it: nothing is left in ``/dev/shm``, even after a crash.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import struct
import time
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
from fsdp2lab.runtime.torch_compat import group_timeout_s, set_custom_collectives

log = logs.get_logger(__name__)

SHM_DIR = "/dev/shm"
_ALIGN = 1 << 16  # slot sizes grow in 64 KiB steps, to the largest unit
_LINE = 64  # the file starts with each rank's barrier count, alone on its cache line
_PAGE = 4096  # the slots start on a page
# x86-64 makes a core's stores visible to the others in program order (x86-TSO): a rank that
# sees a peer's count also sees the slot the peer wrote before it. Elsewhere: gloo's barrier.
SHM_BARRIER = platform.machine().lower() in ("x86_64", "amd64")


class ShmBarrier:
    """A barrier on counts in shared memory: each rank writes how many barriers it has reached
    to its own count, then polls every rank's until all have reached as many.

    Waiting costs the time the last rank takes to arrive, plus a poll: gloo's barrier adds a
    round trip through loopback TCP and its own threads (0.06 against 1.15 ms a barrier here,
    2 ranks each computing 3 ms between barriers: ``scripts/compare_barriers.py``). A rank polls, yielding its core, for
    ``SPIN_S``, then sleeps between polls (50 us, doubling to 1 ms): ranks that share a core
    with others, or wait on a slow one, leave it free. A rank that has not arrived within the
    group's timeout is an error, as in any collective.
    """

    SPIN_S = 0.002

    def __init__(
        self,
        counts: list[memoryview],
        rank: int,
        group: dist.ProcessGroup | None,
        timeout_s: float | None = None,  # None: the group's, read when a wait gets long
    ):
        self.counts, self.rank, self.group, self.timeout_s = counts, rank, group, timeout_s

    def wait(self, target: int) -> None:
        counts = self.counts
        counts[self.rank][0] = target
        start = time.perf_counter()
        polls, nap, deadline = 0, 5e-5, None
        while any(c[0] < target for c in counts):
            polls += 1
            if polls % 64 or time.perf_counter() - start < self.SPIN_S:
                os.sched_yield()
                continue
            if deadline is None:
                timeout_s = self.timeout_s or group_timeout_s(self.group) or 1800.0
                deadline = start + timeout_s
            if time.perf_counter() > deadline:
                raise RuntimeError(self._late(target, time.perf_counter() - start))
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def _late(self, target: int, waited_s: float) -> str:
        ranks = dist.get_process_group_ranks(self.group) if self.group else range(len(self.counts))
        late = [r for r, c in zip(ranks, self.counts, strict=True) if c[0] < target]
        return (
            f"fsdp2lab: shared-memory barrier: rank(s) {late} did not arrive within "
            f"{waited_s:.0f} s (the group's timeout)"
        )


class ShmArena:
    """``SLOTS`` slots, mapped by every rank of ``group`` from one file that rank 0 makes; grown
    on demand.

    A collective of ``n`` bytes a rank takes one slot, where rank ``r`` writes bytes
    ``[r * n, (r + 1) * n)``: the slot's first ``size * n`` bytes are the ranks' inputs
    concatenated in rank order, which is an all-gather's output. Every rank calls the same
    collectives in the same order (as for any process group), so every rank grows its slots,
    falls back, picks a slot and passes a barrier at the same call.
    """

    SLOTS = 4  # enough for a step's steady state: an all-gather and a reduce-scatter per barrier
    HELD = 2  # at most this many slots held as all-gather outputs (the others keep turning)

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=group)
        self.token: str = token[0]
        self.capacity = 0  # bytes a rank, per slot
        self.generation = 0
        self.slots: list[torch.Tensor] = []  # uint8, size * capacity bytes each
        self.shm_barrier: ShmBarrier | None = None  # on the current file's counts
        self.usable = True
        self.barriers = 0
        self.read_at = [-1] * self.SLOTS  # the barrier count when each slot was last read
        self.calls = 0
        self.pending: dict[int, tuple[int, Callable[[], None]]] = {}  # call: (slot, read)
        self.leased: int | None = None  # a slot handed out to be written, then published
        self.lease_held = False  # the lease is an all-gather's output: held once published
        self.held: dict[int, tuple[int, int]] = {}  # call: (generation, slot), until released

    def _path(self) -> str:
        return os.path.join(SHM_DIR, f"fsdp2lab-{self.token}-{self.generation}")

    def _agree(self, ok: bool) -> bool:
        """True if ``ok`` on every rank of the group."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def reserve(self, nbytes: int) -> bool:
        """Slots of at least ``nbytes`` a rank; False (on every rank, for good) where they cannot
        be. Collectives still pending, and held outputs, keep the old file mapped."""
        if not self.usable:
            return False
        if nbytes <= self.capacity:
            return True
        capacity = -(-nbytes // _ALIGN) * _ALIGN
        self.generation += 1
        path, why = self._path(), ""
        header = -(-self.size * _LINE // _PAGE) * _PAGE
        size = header + self.SLOTS * self.size * capacity
        if self.rank == 0:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                    for r in range(self.size):  # every rank's count so far
                        os.pwrite(fd, struct.pack("q", self.barriers), r * _LINE)
                finally:
                    os.close(fd)
            except OSError as e:
                why = f"{path}: {e.strerror or e}"
        mapped, counts = None, []
        if self._agree(not why):
            try:
                mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                if SHM_BARRIER:
                    with open(path, "r+b") as f:
                        view = memoryview(mmap.mmap(f.fileno(), header))
                    counts = [view[r * _LINE : r * _LINE + 8].cast("q") for r in range(self.size)]
            except (OSError, RuntimeError) as e:
                why = f"the shared buffer cannot be mapped here ({e})"
        ok = self._agree(not why)  # every rank has mapped (or failed): the file can go
        if self.rank == 0 and os.path.exists(path):
            os.unlink(path)
        if not ok:
            self.sync()  # what is pending was published in the old slots, which still work
            self.usable = False
            self.slots = []
            if why:
                log.warning(
                    f"fsdp2lab: shared-memory collectives off for a group of {self.size} ranks "
                    f"({why}): gloo carries them instead",
                    extra=logs.EVERY_RANK,
                )
            return False
        self.capacity = capacity
        span = self.size * capacity
        self.slots = [
            mapped[header + s * span : header + (s + 1) * span] for s in range(self.SLOTS)
        ]
        if SHM_BARRIER:
            self.shm_barrier = ShmBarrier(counts, self.rank, self.group)
        self.read_at = [-1] * self.SLOTS
        self.pending = {call: (-1, read) for call, (_, read) in self.pending.items()}
        self.leased = None  # in the old slots: published by copying, as any tensor
        return True

    def _free_slot(self) -> int:
        """A slot no collective is pending in, not leased or held, and that every rank has read
        since it was last written: read before the latest barrier."""
        while True:
            busy = {slot for slot, _ in self.pending.values()} | {self.leased}
            busy |= {slot for gen, slot in self.held.values() if gen == self.generation}
            for s in range(self.SLOTS):
                if s not in busy and self.read_at[s] < self.barriers:
                    return s
            if self.pending:
                self.sync()
            else:
                self._barrier()

    def _barrier(self) -> None:
        if self.shm_barrier is not None:
            self.shm_barrier.wait(self.barriers + 1)
        else:
            dist.barrier(group=self.group)
        self.barriers += 1

    def lease(self, nbytes: int) -> torch.Tensor | None:
        """This rank's part of a free slot, to write a collective's ``nbytes`` input into before
        it is published (no copy then); None where the group has no slots. One lease at a time."""
        self.leased = None
        if not self.reserve(nbytes):
            return None
        self.leased, self.lease_held = self._free_slot(), False
        return self.slots[self.leased][self.rank * nbytes : (self.rank + 1) * nbytes]

    def lease_output(self, nbytes: int) -> torch.Tensor | None:
        """Every rank's part of a free slot, ``nbytes`` each: an all-gather's output, whose own
        part is then published as its input. The slot stays held from its publication until
        :meth:`release`, whose caller reads it before its next collective. None where the group
        has no slots, or already holds ``HELD``."""
        self.leased = None
        held = sum(gen == self.generation for gen, _ in self.held.values())
        if held >= self.HELD or not self.reserve(nbytes):
            return None
        self.leased, self.lease_held = self._free_slot(), True
        return self.slots[self.leased][: self.size * nbytes]

    def publish(self, data: torch.Tensor, read: Callable[[list[torch.Tensor]], None]) -> int:
        """Write ``data`` (contiguous) to a slot, unless it is this rank's part of the leased
        slot already; once every rank has written its own (at the next :meth:`sync`), ``read``
        gets every rank's part viewed like ``data`` (flat). Returns the call's number, for
        :meth:`done` and :meth:`release`."""
        n, s = _bytes(data), self.leased
        mine = slice(self.rank * n, (self.rank + 1) * n)
        in_place = s is not None and data.data_ptr() == self.slots[s][mine].data_ptr()
        if in_place:
            self.leased = None
        else:  # a lease not (yet) published stays busy
            s = self._free_slot()
        parts = [self.slots[s][r * n : (r + 1) * n].view(data.dtype) for r in range(self.size)]
        if not in_place:
            parts[self.rank].copy_(data.reshape(-1))
        self.calls += 1
        self.pending[self.calls] = (s, lambda: read(parts))
        if in_place and self.lease_held:
            self.held[self.calls] = (self.generation, s)
        return self.calls

    def sync(self) -> None:
        """One barrier, after which every pending collective reads its slots."""
        self._barrier()
        for call, (s, read) in self.pending.items():
            read()
            if s >= 0 and call not in self.held:
                self.read_at[s] = self.barriers
        self.pending.clear()

    def done(self, call: int) -> bool:
        return call not in self.pending

    def release(self, call: int) -> None:
        """A held output read (the caller reads it now, before its next collective): its slot
        turns again after the next barrier, which every rank passes only once it has read."""
        gen, s = self.held.pop(call, (None, -1))
        if gen == self.generation:
            self.read_at[s] = self.barriers


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shm_all_gather(arena: ShmArena, output: torch.Tensor, input: torch.Tensor) -> int:
    """``output`` = the ranks' ``input`` tensors, concatenated in rank order, once the returned
    call is done (at the group's next barrier). Where ``output`` is a slot leased with
    :meth:`ShmArena.lease_output`, and ``input`` its own part, nothing is copied at all."""

    def read(parts: list[torch.Tensor]) -> None:
        chunks = output.view(arena.size, -1)
        for r, part in enumerate(parts):
            ptr = chunks[r].data_ptr()
            if ptr != part.data_ptr() and (r != arena.rank or ptr != input.data_ptr()):
                chunks[r].copy_(part.view_as(chunks[r]))

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
        self.arena.release(self.call)  # FSDP2 copies its output out at once
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

    def only(self) -> ShmArena | None:
        """The arena, where exactly one group has one."""
        return next(iter(self.by_group.values())) if len(self.by_group) == 1 else None


class ShmAllGather(RingAllGather):
    """FSDP2's all-gather through shared memory; the ring where the group cannot share it.

    Every all-gather returns work, asynchronous or not: FSDP2 waits for it before it reads the
    output, so the barrier can wait until then, or until a later collective of the group passes
    one. A prefetched all-gather thus shares the barrier of the reduce-scatter issued before
    the unit runs (an all-gather per block in backward) instead of passing its own.

    FSDP2 asks :meth:`allocate` for the output, copies its shards into its own rank's part and
    all-gathers that part. Where one group's arena serves every collective, the output is
    leased in a slot: every rank writes its part straight into the others' output, and FSDP2
    copies the parameters out of it after ``wait``, which releases the slot.
    """

    def __init__(self, arenas: _Arenas):
        self.arenas = arenas

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        arena, numel = self.arenas.only(), math.prod(int(n) for n in size)
        if arena is not None and device.type == "cpu" and numel % arena.size == 0:
            output = arena.lease_output(numel // arena.size * dtype.itemsize)
            if output is not None:
                return output.view(dtype).view(*size)
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        arena = self.arenas.get(group)
        if arena.reserve(_bytes(input_tensor)):
            return ShmWork(arena, shm_all_gather(arena, output_tensor, input_tensor))
        ring_all_gather(output_tensor, input_tensor, group)
        return None


class ShmReduceScatter(RingReduceScatter):
    """FSDP2's reduce-scatter (SUM, AVG) through shared memory; otherwise as the ring's.

    FSDP2 asks :meth:`allocate` for the input (it copies the gradients into it), then for the
    output, then reduces. Where one group's arena serves every collective (FSDP2 over one
    shard group), the input is leased in that arena's slots: published without a copy.
    """

    def __init__(self, arenas: _Arenas):
        self.arenas = arenas
        self.input_next = True  # the next allocation is a reduce-scatter's input

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        arena, self.input_next = self.arenas.only() if self.input_next else None, False
        numel = math.prod(int(n) for n in size)
        if arena is not None and device.type == "cpu":
            leased = arena.lease(numel * dtype.itemsize)
            if leased is not None:
                return leased.view(dtype).view(*size)
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.input_next = True
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
