"""``--eval-every-steps N``: evaluate on the test set every N optimizer steps, as well as after
each epoch (a step that ends the epoch or the run is left to that evaluation)."""

from __future__ import annotations

from fsdp2lab.training.hooks import Hooks


class PeriodicEval(Hooks):
    def __init__(self, every_steps: int):
        self.every_steps = every_steps

    def after_step(self, trainer) -> None:
        if trainer.state.step % self.every_steps or trainer.epoch_complete() or trainer.done():
            return
        trainer.run_eval()
