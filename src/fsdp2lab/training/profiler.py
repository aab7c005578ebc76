"""``--profile DIR``: a torch.profiler trace of a few steps after warm-up, and where each went.

Every rank writes ``DIR/rank<R>.pt.trace.json`` (open it in chrome://tracing or Perfetto, or
point TensorBoard's profiler plugin at DIR). Rank 0 logs the per-step breakdown of its trace
(:mod:`fsdp2lab.training.trace`: compute, exposed_comm, data, optimizer, host) and writes it to
the metrics file (``event: "profile"``), where ``fsdp2lab report`` finds it.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, schedule

from fsdp2lab.runtime import logs
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.trace import DATA_RANGE as DATA_RANGE  # the trainer's range
from fsdp2lab.training.trace import breakdown, summarize, table, trace_path

log = logs.get_logger(__name__)


class Profiler(Hooks):
    """Record ``active`` steps after ``warmup`` steps (fewer where the run is shorter)."""

    def __init__(self, folder: str, rank: int, is_main: bool, warmup: int = 5, active: int = 5):
        self.folder, self.rank, self.is_main = Path(folder), rank, is_main
        self.warmup, self.active = warmup, active
        self.prof: profile | None = None
        self.written = False

    def before_fit(self, trainer) -> None:
        steps_left = trainer.total_steps - trainer.state.step
        active = max(1, min(self.active, steps_left - 1))
        wait = max(0, min(self.warmup, steps_left - active - 1))
        activities = [ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        else:  # without it Kineto logs an ERROR line that it found no GPU
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.trainer = trainer
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
            on_trace_ready=self._ready,
        )
        self.prof.start()

    def after_step(self, trainer) -> None:
        if self.prof is not None:
            self.prof.step()

    def after_fit(self, trainer) -> None:
        self.close()

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
            if not self.written and self.is_main:
                log.warning("fsdp2lab: --profile: the run ended before the profiled steps")

    def _ready(self, prof: profile) -> None:
        path = trace_path(self.folder, self.rank)
        prof.export_chrome_trace(str(path))
        self.written = True
        if not self.is_main:
            return
        steps = breakdown(path)
        summary = summarize(steps)
        log.info(f"fsdp2lab: profile of {len(steps)} steps written to {path}\n{table(summary)}")
        self.trainer.metrics.write("profile", trace=str(path), steps=len(steps), **summary)
