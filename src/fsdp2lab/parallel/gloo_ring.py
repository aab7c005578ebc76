"""Ring all-gather and reduce-scatter for FSDP2 on gloo (CPU).

gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` all-reduces the whole input and
keeps a slice, moving twice the data a reduce-scatter needs. Measured here
(``scripts/bench_gloo_collectives.py``, 2 and 4 CPU ranks, 1.2 M and 3.3 M fp32 elements): gloo's
reduce-scatter takes as long as an all-reduce or longer, 1.7-2.6x this ring; its all-gather
1.1-1.4x the ring's. With gloo's own, FSDP2 pays about an all-gather plus an all-reduce per unit
where DDP pays one all-reduce. These rings send each rank ``N-1`` chunks of ``1/N`` of the data
over gloo's point-to-point channels: the volume of a true all-gather and reduce-scatter.

FSDP2 takes them through ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``
(torch >= 2.9; before, gloo's own run: :mod:`fsdp2lab.runtime.torch_compat`); NCCL keeps its own
collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp2lab.runtime.torch_compat import (
    AllGatherBase,
    ReduceScatterBase,
    all_gather_single,
    reduce_scatter_single,
    set_custom_collectives,
)


class _PlainAlloc:
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RingAllGather(_PlainAlloc, AllGatherBase):
    """All-gather over a ring; an asynchronous request (explicit prefetch) keeps gloo's own,
    which runs on gloo's thread and so overlaps compute."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if async_op:
            return all_gather_single(output_tensor, input_tensor, group, async_op=True)
        ring_all_gather(output_tensor, input_tensor, group)
        return None


class RingReduceScatter(_PlainAlloc, ReduceScatterBase):
    """Reduce-scatter over a ring for SUM (what FSDP2 asks of gloo here:
    :func:`fsdp2lab.parallel.fsdp2.reduce_with_sum`) and AVG; others use gloo's."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return reduce_scatter_single(output_tensor, input_tensor, op, group, async_op=async_op)
        ring_reduce_scatter(output_tensor, input_tensor, group)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())
        return None


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Send to the next rank of the ring while receiving from the previous one."""
    size, rank = group.size(), group.rank()
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` = the ranks' ``input`` tensors, concatenated in rank order.

    At step ``s`` each rank passes on chunk ``rank - s``, which it has, and receives chunk
    ``rank - s - 1`` from the previous rank.
    """
    size, rank = group.size(), group.rank()
    chunks = output.view(size, -1)
    chunks[rank].copy_(input.view(-1))
    for step in range(size - 1):
        _exchange(chunks[(rank - step) % size], chunks[(rank - step - 1) % size], group)


def ring_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> None:
    """``output`` = the sum over ranks of chunk ``rank`` of ``input`` (``input`` is left as is).

    At step ``s`` each rank passes its running sum of chunk ``rank - s - 1`` to the next rank and
    adds its own copy of chunk ``rank - s - 2`` to what the previous rank passed it; after
    ``N - 1`` steps it holds the whole sum of chunk ``rank``.
    """
    size, rank = group.size(), group.rank()
    chunks = input.view(size, -1)
    partial = chunks[(rank - 1) % size].clone()
    received = torch.empty_like(partial)
    for step in range(size - 1):
        _exchange(partial, received, group)
        torch.add(received, chunks[(rank - step - 2) % size], out=partial)
    output.view(-1).copy_(partial)


def use_ring_collectives(model: torch.nn.Module) -> bool:
    """Give every FSDP2 module of ``model`` the ring all-gather and reduce-scatter; False where
    this torch's FSDP2 takes no custom collectives (gloo's own then run)."""
    for module in model.modules():
        if isinstance(module, FSDPModule) and not set_custom_collectives(
            module, RingAllGather(), RingReduceScatter(), name="ring"
        ):
            return False
    return True
