"""Gradient norm and clipping that are correct for sharded (DTensor) gradients.

Each rank holds only shards of the gradients, so a local norm would be wrong. The total norm is
computed on the DTensors (a partial norm reduced over the mesh with ``full_tensor``), so it equals the
norm single-process training computes on the full gradients.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def total_grad_norm(parameters) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def clip_grad_norm_(parameters, max_norm: float | None) -> torch.Tensor:
    """Return the full gradient norm; scale the gradients down to ``max_norm`` if it is given."""
    parameters = list(parameters)
    norm = total_grad_norm(parameters)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
