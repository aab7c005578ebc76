"""Checkpoint faults for the drills in tests/test_faults.py; each is off unless its variable is set
(the training faults are the hook in ``training/fault_drills.py``).

| variable | effect |
|---|---|
| ``FSDP2LAB_CKPT_CRASH_AT=RANK:STEP`` | that rank dies right after writing its shards of that step's save |
| ``FSDP2LAB_CKPT_ENOSPC_AT=RANK:STEP`` | that rank's write of that step's save fails: "No space left" |
| ``FSDP2LAB_CKPT_STALL_AT=RANK:STEP`` | that rank's write of that step's save hangs (a save in flight) |
| ``FSDP2LAB_HF_SLOW_AT=RANK:STEP`` | that rank's ``--save-hf`` write of that step takes 3 s longer |
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from fsdp2lab.runtime import logs
from fsdp2lab.runtime.torch_compat import hf_shard_writer

log = logs.get_logger(__name__)


def injected_at(name: str, rank: int, step: int) -> bool:
    """Whether variable ``name`` (``RANK:STEP``) names this rank and step."""
    spec = os.environ.get(name)
    return bool(spec) and [int(v) for v in spec.split(":")] == [rank, step]


def checkpoint_writer(path: Path, rank: int, step: int) -> dcp.FileSystemWriter:
    """DCP's file writer, or one that fails as asked for this rank and step."""
    if injected_at("FSDP2LAB_CKPT_CRASH_AT", rank, step):
        return _CrashAfterWrite(path)
    if injected_at("FSDP2LAB_CKPT_ENOSPC_AT", rank, step):
        return _DiskFull(path)
    if injected_at("FSDP2LAB_CKPT_STALL_AT", rank, step):
        return _Stall(path)
    return dcp.FileSystemWriter(path)


SLOW_S = 3.0


def hf_writer(path: str, fqn_to_index: dict[str, int], rank: int, step: int):
    """DCP's Hugging Face shard writer (:func:`~fsdp2lab.runtime.torch_compat.hf_shard_writer`),
    or one that writes ``SLOW_S`` seconds late as asked for this rank and step."""
    writer = hf_shard_writer(path, fqn_to_index)
    if injected_at("FSDP2LAB_HF_SLOW_AT", rank, step):
        write = writer.write_data

        def slow(plan, planner):
            time.sleep(SLOW_S)
            return write(plan, planner)

        writer.write_data = slow
    return writer


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
