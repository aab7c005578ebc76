"""What the trainer shares with the code that hooks into it: the train state, the hook points
and the way to stop early. Checkpointing, preemption and other observers import this module, not
the trainer; they log through ``fsdp2lab.runtime.logs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


@dataclass
class TrainState:
    """Where training is, counted in world-size-independent units."""

    epoch: int = 1  # the epoch in progress (1-based, as the seed prints it)
    step: int = 0  # optimizer steps done
    samples_seen: int = 0  # global samples consumed
    epoch_samples: int = 0  # global samples of the current epoch consumed


class Hooks:
    """Extension points (checkpointing, preemption, guards, observers), called on every rank."""

    def before_fit(self, trainer: Trainer) -> None: ...
    def epoch_started(self, trainer: Trainer) -> None: ...  # data iterator made, no step yet
    def before_optimizer_step(self, trainer: Trainer, loss: torch.Tensor) -> bool | torch.Tensor:
        """Gradients are ready; return True to drop this step's update, or a 0-dim tensor on the
        device that drops it where it is 1.0 (only where ``optim.skips_on_device``)."""
        return False

    def settle(self, trainer: Trainer) -> None:
        """Read what the device decided since the last call (step records, epoch ends, saves)."""

    def after_step(self, trainer: Trainer) -> None: ...
    def after_step_record(self, trainer: Trainer, record: dict) -> None:
        """A step record was written (when its values reached the host: a step or more after
        its own step on a GPU)."""

    def after_eval(self, trainer: Trainer, record: dict) -> None:
        """An evaluation ran: ``record`` is its ``eval`` metrics record (step, epoch,
        elapsed_s, test_loss, test_accuracy, ...)."""

    def after_epoch(self, trainer: Trainer) -> None: ...
    def after_fit(self, trainer: Trainer) -> None: ...


class StopTraining(Exception):
    """Raised by a hook to end training at once (e.g. after a preemption checkpoint): no summary,
    no final save. A hook that wants a normal end sooner calls ``trainer.request_stop``."""
