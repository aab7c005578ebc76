"""``--save-hf DIR``: the trained model as a Hugging Face folder, written from every rank at the
end of training (and every ``--save-hf-every-steps`` steps) by :mod:`fsdp2lab.checkpoint.hf_save`.

A save that fails (disk full, I/O error) is a warning and training goes on; if the last one
failed, the run ends with exit code 1. Weights that are not finite are never saved. With
``--async-checkpoint`` the shards are copied to memory at once and the folder is written by
background threads while training goes on, at most one save in flight; the run waits for the
last one before it ends.

The folder itself is checked with the plan (``plan.check_machine``: in the launcher, before any
worker starts: :func:`fsdp2lab.checkpoint.hf_save.check_target`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.api import CheckpointException

from fsdp2lab.checkpoint.hf_save import run_info, save_hf
from fsdp2lab.checkpoint.safetensors_export import DEFAULT_MAX_SHARD_SIZE
from fsdp2lab.config import TrainConfig, parse_size
from fsdp2lab.errors import TrainingFailed
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime, new_io_group
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.nan_guard import trained_weights_finite

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer

log = logs.get_logger(__name__)


class SaveHF(Hooks):
    def __init__(self, cfg: TrainConfig, runtime: Runtime):
        self.out, self.every, self.runtime = cfg.save_hf, cfg.save_hf_every_steps, runtime
        self.group = new_io_group(runtime)
        self.run: dict = {}
        self.asynchronous = cfg.async_checkpoint
        self.dtype = cfg.save_dtype
        self.max_shard_size = (
            parse_size(cfg.max_shard_size) if cfg.max_shard_size else DEFAULT_MAX_SHARD_SIZE
        )
        self.in_flight: tuple[Future, int, float] | None = None
        self.saved_step: int | None = None
        self.failed: str | None = None
        adapter = cfg.lora_rank is not None and not cfg.merge
        self.what = "PEFT adapter" if adapter else "Hugging Face model"
        if cfg.quantize_base and cfg.merge:
            self.what += " (adapters merged into the source folder's weights, not the NF4 ones)"

    def before_fit(self, trainer: Trainer) -> None:
        plan = trainer.plan  # the folder was checked with the plan
        self.run = run_info(plan.cfg, plan.meta_model, plan.spec.source)

    def after_step(self, trainer: Trainer) -> None:
        if self.in_flight is not None and self.in_flight[0].done():
            self._wait()
        if self.every and trainer.state.step % self.every == 0 and not trainer.done():
            self.save(trainer)

    def after_fit(self, trainer: Trainer) -> None:
        self.save(trainer)

    def check(self) -> None:
        """Wait for a save in flight; a TrainingFailed if the run's last save failed."""
        self._wait()
        if self.failed:
            raise TrainingFailed(f"--save-hf {self.out}: the model was not saved: {self.failed}")

    def save(self, trainer: Trainer) -> None:
        """Write the current step's model (a collective: every rank calls it at the same step)."""
        step = trainer.state.step
        if step == self.saved_step:
            return
        self._wait()
        trainer.settle()  # the NaN guard's verdicts up to this step first
        self.saved_step = step
        if not trained_weights_finite(trainer.model, trainer.device):
            self.failed = "non-finite weights"
            if self.runtime.is_main:
                log.warning(
                    f"fsdp2lab: warning: {self.out} not saved at step {step}: non-finite weights"
                )
            return
        started = time.perf_counter()
        try:
            files = save_hf(trainer.model, self.out, self.run, self.group, self.max_shard_size,
                            self.asynchronous, step, self.dtype)  # fmt: skip
        except (CheckpointException, OSError) as e:
            return self._failed(step, e)
        if isinstance(files, Future):
            self.in_flight = (files, step, started)
            return
        self._saved(step, files, started)

    def _wait(self) -> None:
        if self.in_flight is None:
            return
        (future, step, started), self.in_flight = self.in_flight, None
        try:
            files = future.result()
        except (CheckpointException, OSError) as e:
            return self._failed(step, e)
        self._saved(step, files, started)

    def _failed(self, step: int, error: BaseException) -> None:
        self.failed = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        if self.runtime.is_main:
            log.warning(f"fsdp2lab: warning: {self.out} not saved at step {step}: {self.failed}")

    def _saved(self, step: int, files: list[Path], started: float) -> None:
        self.failed = None
        if self.runtime.is_main:
            size = sum(f.stat().st_size for f in files)
            log.info(
                f"fsdp2lab: {self.what} saved to {self.out} at step {step} "
                f"({size / 1e6:.2f} MB, {time.perf_counter() - started:.2f}s)"
            )
