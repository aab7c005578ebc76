"""Where a profiled training step went, from a torch.profiler trace (plain JSON: no torch here,
so that ``fsdp2lab report`` stays light). The parts of a step (they add up to it):

- ``data``: fetching and moving the batch (the trainer's ``fsdp2lab.data`` range);
- ``optimizer``: ``Optimizer.step`` and ``zero_grad``;
- ``exposed_comm``: time the step waits on communication. On GPUs, collective kernels that no
  compute kernel overlaps. On CPU, the training thread in collective calls and FSDP2's copies
  around them, and any time a collective runs on gloo's own threads (DDP's all-reduce, a
  prefetched all-gather) while the training thread runs no operator;
- ``compute``: on GPUs, compute kernels; on CPU, the training thread's operators outside the
  above and outside FSDP2's hooks;
- ``host``: the rest of the step: Python, FSDP2's hooks, DTensor dispatch, launch gaps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA_RANGE = "fsdp2lab.data"
PARTS = ("compute", "exposed_comm", "data", "optimizer", "host")
# Host-side names of communication: c10d ops and gloo's, FSDP2's collectives and the copies
# around them (fsdp::all_gather_copy_in, fsdp::chunk_cat, ...).
_COMM = re.compile(
    r"^(c10d::|_c10d_functional::wait|gloo:|nccl:|record_param_comms|fsdp::|"
    r"FSDP::(all_gather|post_backward_reduce))"
)
_FSDP_HOOKS = re.compile(r"^FSDP::")
_OPTIMIZER = re.compile(r"^Optimizer\.(step|zero_grad)")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
# What a CUDA trace records on the GPU's lanes (a stream each): kernels, copies, and the copies
# of the host's record_function ranges.
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def trace_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.pt.trace.json"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of union ``a`` outside union ``b``."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _clip(intervals, start: float, end: float) -> list[tuple[float, float]]:
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


def _lane(event: dict) -> tuple:
    return event.get("pid"), event.get("tid")


def breakdown(trace: str | Path) -> list[dict[str, float]]:
    """Per profiled step, milliseconds of each of ``PARTS`` (they add up to ``step``).

    The steps are the training thread's ``ProfilerStep#N`` ranges: a CUDA trace also has each
    range's copy on the GPU stream's lane (category ``gpu_user_annotation``), left out."""
    events = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in _DEVICE]
    events = [e for e in events if e.get("cat") not in _DEVICE]
    steps = [e for e in events if _STEP.match(e.get("name", ""))]
    if not steps:
        return []
    main = _lane(min(steps, key=lambda e: e["ts"]))
    steps = [e for e in steps if _lane(e) == main]
    kernels = [e for e in device if e.get("cat") == "kernel"]

    def spans(pred, evs) -> list[tuple[float, float]]:
        return _union([(e["ts"], e["ts"] + e["dur"]) for e in evs if pred(e["name"])])

    host = [e for e in events if _lane(e) == main and not _STEP.match(e["name"])]
    others = [e for e in events if _lane(e) != main and isinstance(e["tid"], int)]
    data = spans(lambda n: n == DATA_RANGE, host)
    optimizer = _minus(spans(_OPTIMIZER.match, host), data)
    taken = _union(data + optimizer)
    if kernels:  # GPU: what the device did
        comm_k = spans(lambda n: "nccl" in n.lower(), kernels)
        compute = _minus(spans(lambda n: "nccl" not in n.lower(), kernels), taken)
        comm = _minus(_minus(comm_k, compute), taken)
    else:  # CPU: what the training thread did, and what gloo's threads did while it waited
        ops = spans(lambda n: n.startswith("aten::"), host)
        background = _minus(spans(_COMM.match, others), ops)
        comm = _minus(_union(spans(_COMM.match, host) + background), taken)
        hooks = spans(_FSDP_HOOKS.match, host)
        compute = _minus(_minus(_minus(ops, comm), hooks), taken)
    out = []
    for step in sorted(steps, key=lambda e: e["ts"]):
        start, end = step["ts"], step["ts"] + step["dur"]
        parts = {
            "data": _length(_clip(data, start, end)),
            "optimizer": _length(_clip(optimizer, start, end)),
            "exposed_comm": _length(_clip(comm, start, end)),
            "compute": _length(_clip(compute, start, end)),
        }
        parts["host"] = max(0.0, step["dur"] - sum(parts.values()))
        out.append({"step": step["dur"] / 1000, **{k: v / 1000 for k, v in parts.items()}})
    return out


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    """The profiled step of median length, its parts in ms as ``<part>_ms`` (they add up)."""
    if not steps:
        return {}
    median = sorted(steps, key=lambda s: s["step"])[(len(steps) - 1) // 2]
    return {f"{k}_ms": median[k] for k in ("step", *PARTS)}


def table(summary: dict[str, float]) -> str:
    step = summary.get("step_ms") or float("nan")
    rows = [f"  {'step':<13}{step:9.2f} ms"]
    for part in PARTS:
        ms = summary.get(f"{part}_ms", float("nan"))
        rows.append(f"  {part:<13}{ms:9.2f} ms  {100 * ms / step:5.1f}%")
    return "\n".join(rows)
