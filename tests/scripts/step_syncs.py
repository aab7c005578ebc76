"""Host waits for the device in each step of a real training run (gloo, CPU ranks).

The run is ``fsdp2lab train``'s own: its ``Trainer`` with the hooks a run gets
(``session.build_hooks``), under ``device_reads.HostWaits``, which counts the calls that, on a
GPU, make the host wait for the device (reads, ops sized by device values, blocking copies, host
values given the device, synchronizes). Each step's count runs from the end of the previous step's
hooks to the end of its own. Rank 0 prints one JSON line: ``{"steps": {step: count}, "kinds":
{step: {kind: count}}, "logged": [steps that wrote a record]}``.

torchrun --nproc-per-node N tests/scripts/step_syncs.py TRAIN_FLAGS...
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.runtime.distributed import Runtime, exit_process, pick_device
from fsdp2lab.training.device_reads import HostWaits
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.preemption import Preemption
from fsdp2lab.training.session import build_hooks
from fsdp2lab.training.trainer import Trainer


class PerStep(Hooks):
    """Each step's tally (``counter.take()``), from the start of its ``train_step`` to the start
    of the next (its hooks and the records written after it included); the last step's to its
    hooks' end, where counting pauses."""

    def __init__(self, counter, trainer: Trainer):
        self.counter, self.steps, self.logged = counter, {}, []
        step_alone = trainer.train_step

        def train_step(batches):
            self._close()
            self.current = trainer.state.step + 1
            last = trainer.cfg.max_steps == self.current
            if trainer.device.type == "cuda":  # no sync unless the step writes a record
                quiet = not (last or trainer.logs_step(self.current))
                torch.cuda.set_sync_debug_mode("error" if quiet else "default")
            return step_alone(batches)

        trainer.train_step = train_step
        self.current: int | None = None

    def _close(self) -> None:
        kinds = self.counter.take()
        if self.current is not None:
            self.steps[self.current] = kinds

    def after_step(self, trainer: Trainer) -> None:
        if trainer.logs_step(trainer.state.step):
            self.logged.append(trainer.state.step)
        if trainer.done():  # the run's end (evaluation, summary) is not a step
            self._close()
            self.current = None
            self.counter.paused = True
            if trainer.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")


class HostLoader:
    """The trainer's loader, not counted: its tensors are on the host on every device (the
    trainer's move of each batch to the device is counted)."""

    def __init__(self, loader, counter: HostWaits):
        self.loader, self.counter = loader, counter

    def __iter__(self):
        with self._paused():
            batches = iter(self.loader)
        while True:
            with self._paused():
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    @contextlib.contextmanager
    def _paused(self):
        self.counter.paused = True
        try:
            yield
        finally:
            self.counter.paused = False


def main() -> None:
    cfg = config_from_args(build_parser().parse_args(["train", *sys.argv[1:]]))
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = pick_device(cfg.device if backend == "nccl" else "cpu", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runtime = Runtime(rank, world, local_rank, device, backend)
    counter = HostWaits(device)
    preemption = Preemption(runtime, None)  # its per-step agreement included
    trainer = Trainer(cfg, runtime, hooks=build_hooks(cfg, runtime, preemption=preemption))
    per_step = PerStep(counter, trainer)
    trainer.hooks.append(per_step)
    trainer.loader = HostLoader(trainer.loader, counter)
    with counter:
        trainer.fit()
    if rank == 0:
        steps = {step: sum(kinds.values()) for step, kinds in per_step.steps.items()}
        print(json.dumps({"steps": steps, "kinds": per_step.steps, "logged": per_step.logged}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
