"""``fsdp2lab report RUN [RUN ...]``: the loss curves of several runs overlaid in one PNG, against
the step and against wall time (seconds since each run's first logged step).

A RUN is a metrics file (``--metrics-file``), a TensorBoard log folder (``--tensorboard``) or event
file, or a folder holding ``metrics.jsonl`` (a ``bench`` run). Where a resumed run logged a step
twice (steps after its last checkpoint, before a crash), the last value counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fsdp2lab.bench.results import read_metrics
from fsdp2lab.errors import UsageError


@dataclass
class Curve:
    name: str  # the RUN as given
    steps: list[int]
    seconds: list[float]  # wall time since the first logged step
    losses: list[float]


def _points(pairs: dict[int, tuple[float, float]]) -> tuple[list[int], list[float], list[float]]:
    steps = sorted(pairs)
    start = min(t for t, _ in pairs.values())
    return steps, [pairs[s][0] - start for s in steps], [pairs[s][1] for s in steps]


def _from_metrics(path: Path) -> dict[int, tuple[float, float]]:
    try:
        records = read_metrics(path)
    except ValueError as e:
        raise UsageError(f"{path} is not a metrics file (JSON lines): {e}") from None
    return {r["step"]: (r["time"], r["loss"]) for r in records if r.get("event") == "step"}


def _from_tensorboard(path: Path) -> dict[int, tuple[float, float]]:
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    events = EventAccumulator(str(path), size_guidance={SCALARS: 0})
    events.Reload()
    if "train/loss" not in events.Tags()[SCALARS]:
        raise UsageError(f"{path}: no train/loss scalars (written by fsdp2lab train --tensorboard)")
    return {e.step: (e.wall_time, e.value) for e in events.Scalars("train/loss")}


def load_curve(run: str) -> Curve:
    path = Path(run)
    if path.is_dir() and (path / "metrics.jsonl").is_file():
        pairs = _from_metrics(path / "metrics.jsonl")
    elif path.is_dir() or path.name.startswith("events.out.tfevents"):
        pairs = _from_tensorboard(path)
    elif path.is_file():
        pairs = _from_metrics(path)
    else:
        raise UsageError(f"run not found: {run}")
    if not pairs:
        raise UsageError(f"{run}: no logged steps")
    return Curve(run, *_points(pairs))


def plot_curves(runs: list[str], out: Path) -> Path:
    """One PNG: loss vs step (left) and vs wall time (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves = [load_curve(run) for run in runs]
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for c in curves:
        by_step.plot(c.steps, c.losses, label=c.name)
        by_time.plot(c.seconds, c.losses, label=c.name)
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax, xlabel in ((by_step, "step"), (by_time, "wall time (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("training loss")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
