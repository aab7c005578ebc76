"""``--save-hf DIR``: the trained model as a Hugging Face folder, written from every rank at the
end of training (and every ``--save-hf-every-steps`` steps) by :mod:`fsdp2lab.checkpoint.hf_save`.

A save that fails (disk full, I/O error) is a warning and training goes on; if the last one
failed, the run ends with exit code 1. Weights that are not finite are never saved.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.api import CheckpointException

from fsdp2lab.checkpoint import state as ckpt_state
from fsdp2lab.checkpoint.hf_save import save_hf
from fsdp2lab.checkpoint.safetensors_export import check_out_folder
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import TrainingFailed
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime, new_io_group, on_rank0
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.nan_guard import all_finite

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer

log = logs.get_logger(__name__)


class SaveHF(Hooks):
    def __init__(self, cfg: TrainConfig, runtime: Runtime):
        self.out, self.every, self.runtime = cfg.save_hf, cfg.save_hf_every_steps, runtime
        self.group = new_io_group(runtime)
        self.run: dict = {}
        self.saved_step: int | None = None
        self.failed: str | None = None
        adapter = cfg.lora_rank is not None and not cfg.merge
        self.what = "PEFT adapter" if adapter else "Hugging Face model"

    def before_fit(self, trainer: Trainer) -> None:
        # The companion files' hashes as this run reads them: a file changed later is not copied.
        source = trainer.plan.spec.source
        self.run = {
            "hf_config": ckpt_state.hf_config_of(trainer.plan.meta_model),
            "hf_source": source,
            "companions": ckpt_state.companion_files(source, trainer.cfg.tokenizer),
            "config": dataclasses.asdict(trainer.cfg),  # a LoRA run's: its adapters' config
        }
        out, run = Path(self.out), self.run  # refused before training, not after it
        on_rank0(lambda: check_out_folder(out, run, {}))

    def after_step(self, trainer: Trainer) -> None:
        if self.every and trainer.state.step % self.every == 0 and not trainer.done():
            self.save(trainer)

    def after_fit(self, trainer: Trainer) -> None:
        self.save(trainer)

    def check(self) -> None:
        """A TrainingFailed if the run's last save failed."""
        if self.failed:
            raise TrainingFailed(f"--save-hf {self.out}: the model was not saved: {self.failed}")

    def save(self, trainer: Trainer) -> None:
        """Write the current step's model (a collective: every rank calls it at the same step)."""
        step = trainer.state.step
        if step == self.saved_step:
            return
        trainer.settle()  # the NaN guard's verdicts up to this step first
        self.saved_step = step
        if not all_finite(trainer.model.parameters(), trainer.device):
            self.failed = "non-finite weights"
            if self.runtime.is_main:
                log.warning(
                    f"fsdp2lab: warning: {self.out} not saved at step {step}: non-finite weights"
                )
            return
        started = time.perf_counter()
        try:
            files = save_hf(trainer.model, self.out, self.run, self.group)
        except (CheckpointException, OSError) as e:
            self.failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            if self.runtime.is_main:
                log.warning(
                    f"fsdp2lab: warning: {self.out} not saved at step {step}: {self.failed}"
                )
            return
        self.failed = None
        if self.runtime.is_main:
            size = sum(f.stat().st_size for f in files)
            log.info(
                f"fsdp2lab: {self.what} saved to {self.out} at step {step} "
                f"({size / 1e6:.2f} MB, {time.perf_counter() - started:.2f}s)"
            )
