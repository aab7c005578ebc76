"""The optimizer step on each rank's local shards of DTensor parameters (FSDP2, HSDP, TP).

The optimizers fsdp2lab builds (Adadelta, Adam, AdamW, SGD) are elementwise: each element is
updated from its own gradient and state. Updating the local tensors inside the DTensors therefore
gives the same bits as updating the DTensors, without DTensor's dispatch of every ``foreach`` op
(tests/test_local_step.py checks the bits).

At rest nothing changes: the optimizer holds the DTensor parameters and DTensor state, which is
what distributed checkpoints save and reshard. A step pre-hook swaps in a local view (each param
group's local tensors, and their state: the DTensor state's own local tensors) and a post-hook
swaps the DTensors back. The view is built once the state exists and kept while the optimizer
holds the same state and parameter lists (a loaded state dict is new state), so a step only moves
each gradient's local tensor onto its local parameter and off it again. A step that would create
state (the first) runs on the DTensors, as does one where a gradient is laid out differently from
its parameter.
"""

from __future__ import annotations

import collections

import torch
from torch.distributed.tensor import DTensor

from fsdp2lab.runtime.torch_compat import local_tensor


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer.step()`` run on local shards; False (and nothing done) without DTensors."""
    if not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        return False
    swap = _Swap(optimizer)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: swap.to_local())
    optimizer.register_step_post_hook(lambda opt, args, kwargs: swap.back())
    return True


class _LocalView:
    """The optimizer seen through local tensors: ``params`` per param group, ``state`` keyed by
    local parameter (DTensor state values replaced by their local tensors; a plain parameter's
    state dict shared)."""

    def __init__(self, opt: torch.optim.Optimizer):
        params = [p for g in opt.param_groups for p in g["params"]]
        self.pairs = [(p, local_tensor(p)) for p in params if isinstance(p, DTensor)]
        self.groups = [g["params"] for g in opt.param_groups]  # the lists this view mirrors
        self.params = [[_unwrap(p) for p in group] for group in self.groups]
        self.state = collections.defaultdict(dict)
        for p in params:
            if p in opt.state and isinstance(p, DTensor):
                values = {k: _unwrap(v) for k, v in opt.state[p].items()}
                self.state[local_tensor(p)] = _LocalState(values, type(opt).__name__)
            elif p in opt.state:
                self.state[p] = opt.state[p]  # the same dict: what the step adds stays
        self.at_rest = opt.state  # the DTensor-keyed state this view mirrors
        self.stateless = [p for p in params if not opt.state.get(p)]

    def fits(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the optimizer still has the parameters and state this view mirrors, and no
        parameter without state has a gradient (its step would create state)."""
        return (
            opt.state is self.at_rest
            and len(opt.param_groups) == len(self.groups)
            and all(
                g["params"] is params
                for g, params in zip(opt.param_groups, self.groups, strict=True)
            )
            and all(p.grad is None for p in self.stateless)
        )

    def take_grads(self) -> bool:
        """Each DTensor gradient's local tensor onto its local parameter. False (none taken)
        where a gradient is laid out unlike its parameter (placements, shape or dtype)."""
        try:
            for p, local in self.pairs:
                grad = p.grad
                if grad is not None:
                    if not isinstance(grad, DTensor) or grad.placements != p.placements:
                        raise ValueError
                    local.grad = local_tensor(grad)  # refuses another shape or dtype
        except (ValueError, RuntimeError):
            self.release_grads()
            return False
        return True

    def release_grads(self) -> None:
        for _, local in self.pairs:
            local.grad = None


class _LocalState(dict):
    """A local parameter's state. The optimizer may update its tensors in place, or assign the
    same objects again, but not replace them: the DTensor state would not follow."""

    def __init__(self, values: dict, optimizer: str):
        super().__init__(values)
        self.optimizer = optimizer

    def __setitem__(self, key, value) -> None:
        if self.get(key) is not value:
            raise RuntimeError(
                f"{self.optimizer} replaced its state {key!r} instead of updating it in place; "
                "it cannot step on local shards"
            )
        super().__setitem__(key, value)


class _Swap:
    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt
        self.view: _LocalView | None = None
        self.swapped: list[list] | None = None  # each group's DTensor params, while swapped

    def to_local(self) -> None:
        self.back()  # after a step that raised: restore before anything else
        opt = self.opt
        if self.view is None or not self.view.fits(opt):
            self.view = _LocalView(opt) if _has_state(opt) else None
        if self.view is None or not self.view.take_grads():
            return
        self.swapped = [group["params"] for group in opt.param_groups]
        for group, params in zip(opt.param_groups, self.view.params, strict=True):
            group["params"] = params
        opt.state = self.view.state

    def back(self) -> None:
        if self.swapped is None:
            return
        opt, view = self.opt, self.view
        for group, params in zip(opt.param_groups, self.swapped, strict=True):
            group["params"] = params
        opt.state = view.at_rest
        self.swapped = None
        view.release_grads()


def _has_state(opt: torch.optim.Optimizer) -> bool:
    """Every parameter with a gradient has its state (a step would not create any)."""
    return all(
        bool(opt.state.get(p)) for g in opt.param_groups for p in g["params"] if p.grad is not None
    )


def _unwrap(value):
    return local_tensor(value) if isinstance(value, DTensor) else value
