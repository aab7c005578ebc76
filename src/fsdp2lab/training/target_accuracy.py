"""``--target-accuracy A``: end training at the first evaluation whose test accuracy is >= A,
and record how long it took (``event: "target_reached"`` in the metrics file)."""

from __future__ import annotations

from fsdp2lab.runtime import logs
from fsdp2lab.training.hooks import Hooks

log = logs.get_logger(__name__)


class TargetAccuracy(Hooks):
    def __init__(self, target: float):
        self.target = target  # a fraction

    def after_eval(self, trainer, record: dict) -> None:
        accuracy = record["test_accuracy"]
        if accuracy < self.target or trainer.stop_reason:
            return
        trainer.metrics.write(
            "target_reached",
            target_accuracy=self.target,
            test_accuracy=accuracy,
            step=record["step"],
            epoch=record["epoch"],
            elapsed_s=record["elapsed_s"],
            samples_seen=trainer.state.samples_seen,
        )
        trainer.request_stop(
            f"test accuracy {100 * accuracy:.2f}% >= target {100 * self.target:.2f}% at step "
            f"{record['step']} (epoch {record['epoch']}), {record['elapsed_s']:.1f} s of training"
        )
