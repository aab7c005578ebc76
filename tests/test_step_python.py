"""The Python fsdp2lab runs per training step does not grow with the model, except where each
parameter must be touched, and there it costs less than the optimizer's own walk of the
parameters (issue: the GPU step does the plain loop's work and no more).

The instrument is ``sys.settrace``'s line events in one FSDP2 step (clipping, fused AdamW) of the
gpt at 4 and at 16 layers, after the optimizer state exists: a count, not a time, so it does not
depend on the machine's load. The model's own code (``fsdp2lab/models``) is left out.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

import fsdp2lab
from fsdp2lab.config import TrainConfig
from fsdp2lab.training.trainer import Trainer

PACKAGE = str(Path(fsdp2lab.__file__).parent)
OPTIMIZERS = str(Path(torch.optim.__file__).parent)


def lines_in_a_step(runtime, n_layers: int) -> tuple[collections.Counter, int]:
    """Line events by where they ran (fsdp2lab's packages, torch.optim), and the parameters."""
    cfg = TrainConfig(model="gpt", n_layers=n_layers, d_model=32, n_heads=2, seq_len=16,
                      vocab_size=64, dataset="synthetic", batch_size=2, progress="off",
                      optimizer="adamw", max_grad_norm=1.0)  # fmt: skip
    trainer = Trainer(cfg, runtime)
    batches = iter(trainer.loader)
    for _ in range(2):  # the first creates the optimizer state
        trainer.train_step(batches)
    counts: collections.Counter = collections.Counter()

    def where(path: str) -> str | None:
        if path.startswith(OPTIMIZERS):
            return "torch.optim"
        if path.startswith(PACKAGE) and not path.startswith(f"{PACKAGE}/models/"):
            return path[len(PACKAGE) + 1 :].split("/")[0]
        return None

    def trace(frame, event, arg):
        place = where(frame.f_code.co_filename)
        if place is None:
            return None

        def count_lines(frame, event, arg):
            if event == "line":
                counts[place] += 1
            return count_lines

        return count_lines

    sys.settrace(trace)
    try:
        trainer.train_step(batches)
    finally:
        sys.settrace(None)
    return counts, sum(1 for _ in trainer.model.parameters())


@pytest.fixture
def small_and_large(one_rank):
    return lines_in_a_step(one_rank, 4), lines_in_a_step(one_rank, 16)


def test_the_trainers_own_step_is_the_same_at_4_and_16_layers(small_and_large):
    """training/ (the step, loss, guards, optimizer call) walks no parameter or module."""
    (small, _), (large, _) = small_and_large
    assert small["training"] > 0
    assert large["training"] <= 1.2 * small["training"], (small, large)


def test_per_parameter_python_costs_less_than_the_optimizers_own(small_and_large):
    """Stepping on local shards (parallel/) moves each gradient's local tensor on and off its
    parameter, and the norm lists the gradients: per parameter, less Python than torch's AdamW
    spends on the same parameter (0.68x; on fe5689d, 2.5x)."""
    (small, n_small), (large, n_large) = small_and_large
    added = n_large - n_small

    def per_parameter(where: str) -> float:
        return (large[where] - small[where]) / added

    ours = sum(per_parameter(w) for w in set(large) | set(small) if w != "torch.optim")
    assert per_parameter("torch.optim") > 5  # the instrument sees the optimizer's walk
    assert ours <= 0.75 * per_parameter("torch.optim"), (small, large, n_small, n_large)
