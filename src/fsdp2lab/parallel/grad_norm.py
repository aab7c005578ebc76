"""Gradient norm and clipping that are correct for sharded (DTensor) gradients.

Each rank holds only shards of the gradients, so a local norm would be wrong. The total norm is
computed on the DTensors (a partial norm reduced over the mesh with ``full_tensor``), so it equals the
norm single-process training computes on the full gradients. Pipeline stages hold disjoint
parameters, so their squared norms are summed over the stages' group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(parameters, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The norm of all gradients; with ``pp_group``, over the parameters of every pipeline stage."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    else:
        norm = torch.zeros((), device=parameters[0].device if parameters else "cpu")
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        # Each stage holds different parameters: the total is the root of the summed squares.
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    return norm


def clip_grad_norm_(
    parameters, max_norm: float | None, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Return the full gradient norm; scale the gradients down to ``max_norm`` if it is given."""
    parameters = list(parameters)
    norm = total_grad_norm(parameters, pp_group)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
