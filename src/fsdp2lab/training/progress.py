"""The progress bar (tqdm) on rank 0's stderr: steps of the epoch, loss, samples/s and ETA."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from fsdp2lab.training.hooks import Hooks

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


def wanted(setting: str, is_main: bool) -> bool:
    """``--progress``: on, off, or auto (when stderr is a terminal); only ever on rank 0."""
    return is_main and (setting == "on" or (setting == "auto" and sys.stderr.isatty()))


class ProgressBar(Hooks):
    """One bar per epoch; it ends with the epoch's last step, before the epoch's log lines."""

    REFRESH_S = 0.5  # how often the bar's text changes

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.shown_at = 0.0

    def epoch_started(self, trainer: Trainer) -> None:
        self._close()
        st, cfg = trainer.state, trainer.cfg
        done = st.epoch_samples // trainer.plan.global_batch
        total = trainer.sampler.steps_per_epoch
        if cfg.max_steps is not None:
            total = min(total, done + cfg.max_steps - st.step)
        self.bar = tqdm(
            total=total, initial=done, desc=f"Epoch {st.epoch}", unit="step", file=sys.stderr
        )
        self.shown_at = 0.0

    def after_step(self, trainer: Trainer) -> None:
        bar = self.bar
        if bar is None:
            return
        bar.update(1)
        now = time.monotonic()
        if now - self.shown_at >= self.REFRESH_S or bar.n >= bar.total:
            self.shown_at = now
            info = bar.format_dict  # rate: tqdm's smoothed steps/s, None at first
            steps_per_s = info["rate"] or (info["n"] - info["initial"]) / max(info["elapsed"], 1e-9)
            rate = steps_per_s * trainer.plan.global_batch
            unit, rate = (
                ("tokens/s", rate * trainer.cfg.seq_len)
                if trainer.plan.spec.task == "lm"
                else ("samples/s", rate)
            )
            loss = trainer.last_step_record.get("loss")  # the last step record's: no device read
            shown = f"loss={loss:.4f}, " if loss is not None else ""
            bar.set_postfix_str(f"{shown}{unit}={rate:,.0f}")
        if bar.n >= bar.total:
            self._close()

    def after_fit(self, trainer: Trainer) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
