"""The optimizer step on each rank's local shards of DTensor parameters (FSDP2, HSDP, TP).

The optimizers fsdp2lab builds (Adadelta, Adam, AdamW, SGD) are elementwise: each element is
updated from its own gradient and state. Updating the local tensors inside the DTensors therefore
gives the same bits as updating the DTensors, without DTensor's dispatch of every ``foreach`` op
(tests/test_local_step.py checks the bits).

At rest nothing changes: the optimizer holds the DTensor parameters and DTensor state, which is
what distributed checkpoints save and reshard. A step pre-hook swaps in the local tensors (with
the local gradients) and a post-hook swaps them back. A step that would create state (the first)
runs on the DTensors, as does one where a gradient is laid out differently from its parameter.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdp2lab.runtime.torch_compat import local_tensor


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer.step()`` run on local shards; False (and nothing done) without DTensors."""
    if not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        return False
    swap = _Swap()
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: swap.to_local(opt))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: swap.back(opt))
    return True


class _Swap:
    def __init__(self) -> None:
        self.groups: list[tuple[dict, list]] = []  # (param group, its DTensor params)
        self.params: list[tuple[DTensor, torch.Tensor, dict]] = []  # (param, local, its state)

    def to_local(self, opt: torch.optim.Optimizer) -> None:
        self.back(opt)  # after a step that raised: restore before anything else
        if not all(_fits(p, opt.state.get(p)) for g in opt.param_groups for p in g["params"]):
            return
        for group in opt.param_groups:
            self.groups.append((group, group["params"]))
            group["params"] = [self._local(opt, p) for p in group["params"]]

    def _local(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, DTensor) or p.grad is None:
            return p  # skipped by the step
        local = local_tensor(p)
        local.grad = local_tensor(p.grad)
        state = opt.state.pop(p)
        opt.state[local] = {k: _unwrap(v) for k, v in state.items()}
        self.params.append((p, local, state))
        return local

    def back(self, opt: torch.optim.Optimizer) -> None:
        for group, params in self.groups:
            group["params"] = params
        for p, local, state in self.params:
            for k, v in opt.state.pop(local).items():
                if isinstance(state.get(k), DTensor):
                    if v is not local_tensor(state[k]):
                        raise RuntimeError(
                            f"{type(opt).__name__} replaced its state {k!r} instead of updating "
                            "it in place; it cannot step on local shards"
                        )
                else:
                    state[k] = v
            opt.state[p] = state
            local.grad = None
        self.groups, self.params = [], []


def _fits(p: torch.Tensor, state: dict | None) -> bool:
    """A parameter steps on its local shard if its state exists and its gradient matches it."""
    if not isinstance(p, DTensor) or p.grad is None:
        return True
    grad = p.grad
    return (
        bool(state)
        and isinstance(grad, DTensor)
        and grad.placements == p.placements
        and local_tensor(grad).shape == local_tensor(p).shape
        and grad.dtype == p.dtype
    )


def _unwrap(value):
    return local_tensor(value) if isinstance(value, DTensor) else value
