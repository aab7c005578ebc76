"""A training step walks no module tree: train mode is set once, and FSDP2's gradient-sync
setters (each a walk of every module) run only where their value changes (issue: the GPU step
does the plain loop's work and no more)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fsdp2lab.config import TrainConfig
from fsdp2lab.training.trainer import Trainer

STEPS = 3
SETTERS = ("set_requires_gradient_sync", "set_requires_all_reduce")


def calls_in_steps(runtime, monkeypatch, accum: int, reduce: str) -> collections.Counter:
    cfg = TrainConfig(model="gpt", n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64,
                      dataset="synthetic", batch_size=2, grad_accum_steps=accum, progress="off",
                      grad_accum_reduce=reduce)  # fmt: skip
    trainer = Trainer(cfg, runtime)
    batches = iter(trainer.loader)
    calls: collections.Counter = collections.Counter()
    for owner, name in [(torch.nn.Module, "train"), *((FSDPModule, n) for n in SETTERS)]:
        original = getattr(owner, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    for _ in range(STEPS):
        trainer.train_step(batches)
    assert trainer.model.training and all(m.training for m in trainer.model.modules())
    return calls


def test_one_micro_batch_a_step_walks_nothing(one_rank, monkeypatch):
    assert calls_in_steps(one_rank, monkeypatch, accum=1, reduce="auto") == {}


@pytest.mark.parametrize("reduce", ["once", "every"])
def test_accumulation_sets_the_sync_flag_twice_a_step(one_rank, monkeypatch, reduce):
    """Off for the first micro-batch, on for the last: two setter calls a step, whatever the
    number of micro-batches (with ``every``, FSDP2 reduce-scatters each one and only the
    all-reduce flag changes)."""
    changed = "set_requires_all_reduce" if reduce == "every" else "set_requires_gradient_sync"
    assert calls_in_steps(one_rank, monkeypatch, accum=3, reduce=reduce) == {changed: 2 * STEPS}
