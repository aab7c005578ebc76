"""Measurements and the metrics file: JSON lines written by rank 0 (``--metrics-file``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2lab.parallel.strategies import label
from fsdp2lab.runtime.torch_compat import local_tensor

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


def _local_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = local_tensor(t)
    if hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao's NF4): what it stores
        return sum(_local_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (its shards)."""
    params = grads = opt = 0
    for p in model.parameters():
        params += _local_bytes(p)
        if p.grad is not None:
            grads += _local_bytes(p.grad)
    for state in optimizer.state.values():
        opt += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_state_bytes": opt}


def _peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM (ru_maxrss keeps the high-water mark of
    the parent it was forked from across exec: a worker of a large launcher reports the
    launcher's); ru_maxrss elsewhere."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory_bytes(device: torch.device) -> int:
    """``max_memory_allocated`` on a GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _peak_rss_bytes()


class MemoryMeter:
    """This rank's memory since it was made: peak allocated and reserved (CUDA) or peak RSS and
    its growth (CPU), with the bytes of its parameter, gradient and optimizer-state shards."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rss_start = _peak_rss_bytes() if device.type != "cuda" else 0

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        stats = {"peak_memory_bytes": peak_memory_bytes(self.device)}
        if self.device.type == "cuda":
            stats["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(self.device))
        else:
            stats["rss_growth_bytes"] = stats["peak_memory_bytes"] - self.rss_start
        return {**stats, **state_bytes(model, optimizer)}


def per_rank(
    mine: dict[str, int | float], world_size: int, device: torch.device
) -> dict[str, list]:
    """Every rank's numbers ``mine`` (the same keys on every rank) as key -> list by rank.

    A collective that all ranks call: one all-gather of a float64 row per rank (byte counts below
    2**53 and float32 values are exact in it), where pickled objects would take two.
    """
    if world_size == 1:
        return {key: [value] for key, value in mine.items()}
    row = torch.tensor([float(v) for v in mine.values()], dtype=torch.float64, device=device)
    rows = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row)
    columns = torch.stack(rows).t().tolist()
    return {
        key: [int(v) for v in column] if isinstance(mine[key], int) else column
        for key, column in zip(mine, columns, strict=True)
    }


class Throughput:
    """Global samples (and tokens, for language models) per second since the last mark, timed on
    the device: a CUDA event at each mark (a rate read when its events have passed, as a step
    record's values are), the host's clock on CPU."""

    def __init__(self, tokens_per_sample: int | None, device: torch.device):
        self.tokens_per_sample = tokens_per_sample
        self.cuda = device.type == "cuda"
        self.mark(0)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def mark(self, samples_seen: int) -> None:
        self.at, self.samples = self._now(), samples_seen

    def since_mark(self, samples_seen: int) -> Callable[[], dict[str, float]]:
        """The rates since the last mark, which moves here: a function that gives them once the
        device has passed this point (at once on CPU)."""
        start, end, samples = self.at, self._now(), samples_seen - self.samples
        self.at, self.samples = end, samples_seen

        def rates() -> dict[str, float]:
            out = {"samples_per_s": samples / max(self._seconds(start, end), 1e-9)}
            if self.tokens_per_sample:
                out["tokens_per_s"] = out["samples_per_s"] * self.tokens_per_sample
            return out

        return rates


def summarize(t: Trainer) -> dict:
    """The run's summary record; a collective (every rank's memory is gathered)."""
    memory = per_rank(t.memory.measure(t.model, t.optimizer), t.runtime.world_size, t.device)
    parts = zip(
        memory["param_bytes"], memory["grad_bytes"], memory["optimizer_state_bytes"], strict=True
    )
    memory["sharded_state_bytes"] = [sum(p) for p in parts]
    epochs_run = len(t.epoch_times)
    return {
        "strategy": t.cfg.strategy,
        "label": label(t.cfg, t.plan.dims),
        "world_size": t.runtime.world_size,
        "mesh": {"shape": list(t.mesh.shape), "names": list(t.mesh.mesh_dim_names)},
        "model": t.cfg.model,
        "dataset": t.data_choice.name,
        "mixed_precision": t.cfg.mixed_precision,
        "global_batch_size": t.plan.global_batch,
        "params_total": t.plan.params_total,
        **memory,  # per rank: peak memory, RSS growth or peak reserved, state bytes
        "final_test_loss": t.last_eval.get("test_loss", math.nan),
        "final_test_accuracy": t.last_eval.get("test_accuracy", math.nan),
        "train_time_s": t.train_time_s,
        "time_per_epoch_s": sum(t.epoch_times) / epochs_run if epochs_run else math.nan,
        "samples_per_s": t.state.samples_seen / t.train_time_s if t.train_time_s else math.nan,
        "steps": t.state.step,
        "device": t.device.type,
        "state": asdict(t.state),
    }


class MetricsWriter:
    """Appends one JSON object per line; a no-op where disabled (ranks other than 0, or no file)."""

    def __init__(self, path: str | None, enabled: bool):
        self.path = Path(path) if (path and enabled) else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields) -> dict:
        """Write the record (where enabled) and return it, ``time`` included."""
        record = {"event": event, "time": time.time(), **fields}
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return record
