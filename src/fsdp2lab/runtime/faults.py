"""Fault injection for the drills in tests/test_faults.py; every fault is off unless its variable is set.

| variable | effect |
|---|---|
| ``FSDP2LAB_FAIL_AT=RANK:STEP`` | that rank raises an error at the start of that step |
| ``FSDP2LAB_NAN_AT=RANK:STEP`` | that rank's loss of that step is NaN (so are its gradients) |
| ``FSDP2LAB_CKPT_CRASH_AT=RANK:STEP`` | that rank dies right after writing its shards of that step's save |
| ``FSDP2LAB_CKPT_ENOSPC_AT=RANK:STEP`` | that rank's write of that step's save fails: "No space left" |
| ``FSDP2LAB_CKPT_STALL_AT=RANK:STEP`` | that rank's write of that step's save hangs (a save in flight) |
| ``FSDP2LAB_STEP_DELAY_S=S`` | every rank sleeps S seconds after each step (to signal or kill mid-run) |
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fsdp2lab.runtime import logs

log = logs.get_logger(__name__)


def _at(name: str, rank: int, step: int) -> bool:
    spec = os.environ.get(name)
    return bool(spec) and [int(v) for v in spec.split(":")] == [rank, step]


def step_delay() -> float:
    return float(os.environ.get("FSDP2LAB_STEP_DELAY_S", "0") or 0)


def before_step(rank: int, step: int) -> None:
    if _at("FSDP2LAB_FAIL_AT", rank, step):
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (FSDP2LAB_FAIL_AT)")


def poison_loss(loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return loss * float("nan") if _at("FSDP2LAB_NAN_AT", rank, step) else loss


def checkpoint_writer(path: Path, rank: int, step: int) -> dcp.FileSystemWriter:
    """DCP's file writer, or one that fails as asked for this rank and step."""
    if _at("FSDP2LAB_CKPT_CRASH_AT", rank, step):
        return _CrashAfterWrite(path)
    if _at("FSDP2LAB_CKPT_ENOSPC_AT", rank, step):
        return _DiskFull(path)
    if _at("FSDP2LAB_CKPT_STALL_AT", rank, step):
        return _Stall(path)
    return dcp.FileSystemWriter(path)


class _CrashAfterWrite(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        log.warning("dying mid-save (FSDP2LAB_CKPT_CRASH_AT)", extra=logs.EVERY_RANK)
        os._exit(43)


class _DiskFull(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


class _Stall(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        time.sleep(3600)
        return written
