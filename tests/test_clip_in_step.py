"""Clipping rides on the fused optimizer step (issue: the GPU step does the plain loop's work and
no more): the gradient norm's one read gives the norm and the NaN guard's verdict, and the clip
factor divides the gradients inside fused AdamW (its ``grad_scale``), not in a pass of its own.

16 clipped steps of FSDP2 on one rank equal the loop a user writes (``clip_grad_norm_``, then fused
AdamW) within fp32 rounding, step by step and tensor by tensor; without clipping they do not (the
control). A clipped step dispatches the unclipped step's ops plus 0-dim ones only: no op over the
gradients.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp2lab.config import TrainConfig
from fsdp2lab.training.trainer import Trainer

STEPS = 16
MAX_NORM = 0.05  # below every step's norm: clipping is active on each
CFG = dict(model="gpt", n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64,
           dataset="synthetic", batch_size=4, optimizer="adamw", lr=1e-2, dropout=0.0,
           progress="off", log_every_steps=1)  # fmt: skip
TOL = 2e-6  # fp32 rounding over 16 steps (measured 4.8e-7: 4 ulp of the loss); unclipped: 0.03


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def trainer_run(runtime, max_norm) -> tuple[list[float], list[float], dict]:
    trainer = Trainer(TrainConfig(**CFG, max_grad_norm=max_norm), runtime)
    batches = iter(trainer.loader)
    losses, norms = [], []
    for _ in range(STEPS):
        loss, _ = trainer.train_step(batches)
        losses.append(loss.item())
        norms.append(trainer.last_grad_norm.item())
    return losses, norms, {n: full(p.detach()) for n, p in trainer.model.named_parameters()}


def plain_loop(runtime, max_norm) -> tuple[list[float], dict]:
    """The user's loop over the same model, data and optimizer settings, clipped by torch."""
    trainer = Trainer(TrainConfig(**CFG), runtime)
    model, batches = trainer.model, iter(trainer.loader)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=CFG["lr"], weight_decay=0.0, fused=True)
    losses = []
    for _ in range(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: full(p.detach()) for n, p in model.named_parameters()}


def worst(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_clipped_steps_equal_the_plain_loops_and_unclipped_do_not(one_rank):
    losses, norms, params = trainer_run(one_rank, MAX_NORM)
    assert min(norms) > MAX_NORM  # clipping was active on every step
    want_losses, want_params = plain_loop(one_rank, MAX_NORM)
    assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) <= TOL
    assert worst(params, want_params) <= TOL
    unclipped_losses, unclipped_params = plain_loop(one_rank, None)  # the control
    assert worst(params, unclipped_params) > 1e3 * TOL
    assert max(abs(a - b) for a, b in zip(losses, unclipped_losses, strict=True)) > 1e2 * TOL


class _Ops(TorchDispatchMode):
    """(op, whether any tensor argument holds more than one value), counted."""

    def __init__(self):
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        self.seen[(str(func.overloadpacket), any(t.numel() > 1 for t in tensors))] += 1
        return func(*args, **(kwargs or {}))


def step_ops(runtime, max_norm) -> collections.Counter:
    trainer = Trainer(TrainConfig(**CFG, max_grad_norm=max_norm), runtime)
    batches = iter(trainer.loader)
    trainer.train_step(batches)  # the first step creates the optimizer state
    with _Ops() as ops:
        trainer.train_step(batches)
    return ops.seen


def test_a_clipped_step_adds_no_op_over_the_gradients(one_rank):
    clipped, unclipped = step_ops(one_rank, MAX_NORM), step_ops(one_rank, None)
    extra = clipped - unclipped
    assert extra, "clipping dispatched nothing: the factor never reached the optimizer"
    assert all(not large for _, large in extra), extra  # 0-dim ops only: the factor
    assert not unclipped - clipped


@pytest.mark.parametrize("max_norm", [MAX_NORM, None])
def test_the_optimizer_is_left_without_the_step_attributes(one_rank, max_norm):
    trainer = Trainer(TrainConfig(**CFG, max_grad_norm=max_norm), one_rank)
    trainer.train_step(iter(trainer.loader))
    assert not any(hasattr(trainer.optimizer, a) for a in ("grad_scale", "found_inf"))
