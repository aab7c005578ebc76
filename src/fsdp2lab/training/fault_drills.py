"""Faults the drills (tests/test_faults.py) inject into training, as a hook the session adds only
when one of these variables is set: an ordinary run carries none of it.

| variable | effect |
|---|---|
| ``FSDP2LAB_FAIL_AT=RANK:STEP`` | that rank raises an error in its first forward of that step |
| ``FSDP2LAB_NAN_AT=RANK:STEP`` | that rank's model output of that step is NaN (so are its loss and gradients) |
| ``FSDP2LAB_STEP_DELAY_S=S`` | every rank sleeps S seconds after each step (to signal or kill mid-run) |

The checkpoint writer's faults (a crash, a full disk, a stall mid-save) are in
``runtime/faults.py``.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from fsdp2lab.runtime.faults import injected_at
from fsdp2lab.training.hooks import Hooks

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer

VARIABLES = ("FSDP2LAB_FAIL_AT", "FSDP2LAB_NAN_AT", "FSDP2LAB_STEP_DELAY_S")


def wanted() -> bool:
    return any(os.environ.get(name) for name in VARIABLES)


class FaultDrills(Hooks):
    def __init__(self, rank: int):
        self.rank = rank
        self.delay = float(os.environ.get("FSDP2LAB_STEP_DELAY_S", "0") or 0)

    def before_fit(self, trainer: Trainer) -> None:
        def next_step() -> int:
            return trainer.state.step + 1

        def pre_forward(module, args):
            if module.training and injected_at("FSDP2LAB_FAIL_AT", self.rank, next_step()):
                raise RuntimeError(
                    f"injected failure on rank {self.rank} at step {next_step()} (FSDP2LAB_FAIL_AT)"
                )

        def post_forward(module, args, output):
            if module.training and injected_at("FSDP2LAB_NAN_AT", self.rank, next_step()):
                return _poisoned(output)
            return output

        trainer.model.register_forward_pre_hook(pre_forward)
        trainer.model.register_forward_hook(post_forward)

    def after_step(self, trainer: Trainer) -> None:
        if self.delay:
            time.sleep(self.delay)


def _poisoned(output):
    """``output`` times NaN: a tensor, or the ``logits`` of a model output object."""
    if isinstance(output, torch.Tensor):
        return output * float("nan")
    output.logits = output.logits * float("nan")
    return output
