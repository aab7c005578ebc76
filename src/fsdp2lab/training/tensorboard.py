"""``--tensorboard DIR``: rank 0 writes the metrics file's step and epoch records as scalars.

Tags: ``train/<key>`` (loss, grad_norm, lr, samples_per_s, tokens_per_s), ``memory/<key>/rank<r>``
(peak memory, RSS growth or peak reserved, parameter, gradient and optimizer-state bytes),
``epoch/<key>`` (train and test loss, test accuracy, epoch time, samples/s) and the resolved config
as text. Each scalar carries its record's step and wall time. A resumed run opens the same folder
with ``purge_step`` at the step after its checkpoint: steps a crashed run logged after its last
checkpoint are dropped, so the curves go on without duplicate steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp2lab.runtime import logs
from fsdp2lab.training.hooks import Hooks

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer

log = logs.get_logger(__name__)


_NOT_SCALARS = ("event", "time", "step", "epoch", "samples_seen")


def scalars(record: dict, prefix: str) -> dict[str, float]:
    """The tags and values of a metrics-file record (per-rank lists become ``memory/`` tags)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_SCALARS or value is None:
            continue
        if isinstance(value, list):
            out.update({f"memory/{key}/rank{r}": v for r, v in enumerate(value)})
        elif isinstance(value, (int, float)):
            out[f"{prefix}/{key}"] = value
    return out


class TensorBoardWriter(Hooks):
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.writer = None

    def before_fit(self, trainer: Trainer) -> None:  # after a checkpoint has loaded
        if not trainer.runtime.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter

        step = trainer.state.step
        self.writer = SummaryWriter(self.log_dir, purge_step=step + 1 if step else None)
        self.writer.add_text("config", "```toml\n" + trainer.cfg.to_toml() + "\n```", step)
        log.info(f"fsdp2lab: TensorBoard logs in {self.log_dir}")

    def after_step_record(self, trainer: Trainer, record: dict) -> None:
        self._write(record, "train")

    def after_epoch(self, trainer: Trainer) -> None:
        self._write(trainer.last_epoch_record, "epoch")

    def after_eval(self, trainer: Trainer, record: dict) -> None:
        self._write(record, "eval")

    def after_fit(self, trainer: Trainer) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _write(self, record: dict, prefix: str) -> None:
        if self.writer is None:
            return
        for tag, value in scalars(record, prefix).items():
            self.writer.add_scalar(tag, value, record["step"], walltime=record["time"])
        self.writer.flush()
