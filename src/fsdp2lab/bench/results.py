"""Read a results folder into rows: one per run, from its ``status.json``, config and metrics.

Step time is the median over the intervals between logged steps (``--log-every-steps``): the first
step's one-off costs (lazy initialisation, allocation) and stray slow intervals on a shared machine
do not move it. Throughput is the global batch over the step time.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from fsdp2lab.config import TrainConfig, load_toml
from fsdp2lab.errors import UsageError
from fsdp2lab.training.trace import breakdown, summarize, trace_path

COLUMNS = [
    "run",
    "status",
    "strategy",
    "label",
    "world_size",
    "copies",
    "mesh",
    "model",
    "precision",
    "host_malloc",
    "reshard",
    "repeat",
    "params_total",
    "global_batch_size",
    "steps",
    "time_per_epoch_s",
    "step_time_s",
    "samples_per_s",
    "tokens_per_s",
    "mfu",
    "peak_memory_bytes_max",
    "peak_memory_bytes_per_rank",
    "sharded_state_bytes_max",
    "sharded_state_bytes_per_rank",
    "final_test_loss",
    "final_test_accuracy",
    "target_accuracy",
    "time_to_target_s",
    "steps_to_target",
    "profile_step_ms",
    "profile_compute_ms",
    "profile_exposed_comm_ms",
    "profile_data_ms",
    "profile_optimizer_ms",
    "profile_host_ms",
    "train_time_s",
    "wall_s",
    "device",
    "error",
]
PROFILE_COLUMNS = [c for c in COLUMNS if c.startswith("profile_")]
# Dense peak FLOP/s by GPU name and compute dtype (for model FLOPs utilisation).
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
}


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_time(metrics: Path | list[dict]) -> float | None:
    """Median seconds per optimizer step between logged steps (None with fewer than two)."""
    records = read_metrics(metrics) if isinstance(metrics, Path) else metrics
    steps = [(r["step"], r["time"]) for r in records if r["event"] == "step"]
    rates = [
        (t1 - t0) / (s1 - s0)
        for (s0, t0), (s1, t1) in zip(steps, steps[1:], strict=False)
        if s1 > s0
    ]
    return statistics.median(rates) if rates else None


def model_flops_per_token(cfg: TrainConfig, params: int) -> float:
    """Training FLOPs per token of the gpt: 6 N + 12 L d T (PaLM appendix B)."""
    return 6 * params + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def peak_flops(device_name: str, precision: str) -> float | None:
    for key, table in PEAK_FLOPS.items():
        if key in device_name:
            return table[precision]
    return None


def _row(folder: Path, peak_override: float | None) -> dict:
    status = json.loads((folder / "status.json").read_text())
    row = {c: None for c in COLUMNS}
    row.update(
        run=status["run_id"],
        status="ok" if status["ok"] else "failed",
        strategy=status["strategy"],
        world_size=status["world_size"],
        copies=status.get("copies", 1),
        model=status["model"],
        precision=status["precision"],
        reshard=status["reshard"],
        repeat=status["repeat"],
        wall_s=status["wall_s"],
        error=status["error"],
    )
    copies = [read_metrics(folder / "metrics.jsonl")]
    copies += [read_metrics(p) for p in sorted(folder.glob("metrics-*.jsonl"))]
    summaries = [[r for r in c if r["event"] == "summary"] for c in copies]
    if not status["ok"] or not all(summaries):
        return row
    s = summaries[0][-1]
    cfg = TrainConfig(**load_toml(str(folder / "config.toml")))
    steps = [step_time(c) or (c[-1]["train_time_s"] / max(c[-1]["steps"], 1)) for c in copies]
    # Side by side: the copies' throughputs add up; each copy's batch is its share.
    samples_per_s = sum(s["global_batch_size"] / t for t in steps if t) or math.nan
    step = statistics.median(steps)
    peak = [p for c in summaries for p in c[-1]["peak_memory_bytes"]]
    state = [b for c in summaries for b in c[-1]["sharded_state_bytes"]]
    records = copies[0]
    row.update(**_target_and_profile(records, folder))
    row.update(
        label=s.get("label", s["strategy"]),
        host_malloc=cfg.host_malloc,
        mesh=" x ".join(
            f"{n}={k}" for n, k in zip(s["mesh"]["names"], s["mesh"]["shape"], strict=True)
        ),
        params_total=s["params_total"],
        global_batch_size=s["global_batch_size"] * len(copies),
        steps=s["steps"],
        time_per_epoch_s=s["time_per_epoch_s"],
        step_time_s=step,
        samples_per_s=samples_per_s,
        peak_memory_bytes_max=max(peak),
        peak_memory_bytes_per_rank=";".join(map(str, peak)),
        sharded_state_bytes_max=max(state),
        sharded_state_bytes_per_rank=";".join(map(str, state)),
        final_test_loss=s["final_test_loss"],
        final_test_accuracy=s["final_test_accuracy"],
        train_time_s=s["train_time_s"],
        device=s["device"] if s["device"] == "cpu" else status.get("device_name", s["device"]),
    )
    if s["model"] == "gpt":
        row["tokens_per_s"] = samples_per_s * cfg.seq_len
        peak_flops_s = peak_override or peak_flops(
            status.get("device_name", ""), s["mixed_precision"]
        )
        if s["device"] == "cuda" and peak_flops_s:
            flops = row["tokens_per_s"] * model_flops_per_token(cfg, s["params_total"])
            row["mfu"] = flops / (peak_flops_s * s["world_size"])
    return row


def _target_and_profile(records: list[dict], folder: Path) -> dict:
    """Time to the target accuracy (``--target-accuracy``) and the profile's step breakdown (from
    rank 0's trace where it is there, so that a report applies the current analysis)."""
    out: dict = {}
    reached = [r for r in records if r["event"] == "target_reached"]
    if reached:
        r = reached[-1]
        out.update(
            target_accuracy=r["target_accuracy"],
            time_to_target_s=r["elapsed_s"],
            steps_to_target=r["step"],
        )
    trace = trace_path(folder / "profile", 0)
    profiles = [r for r in records if r["event"] == "profile"]
    if trace.is_file():
        out.update({f"profile_{k}": v for k, v in summarize(breakdown(trace)).items()})
    elif profiles:
        out.update({f"profile_{k}": v for k, v in profiles[-1].items() if k.endswith("_ms")})
    return out


def eval_curve(folder: Path) -> list[tuple[float, float]]:
    """(training seconds, test accuracy) at each evaluation of a run."""
    return [
        (r["elapsed_s"], r["test_accuracy"])
        for r in read_metrics(folder / "metrics.jsonl")
        if r["event"] == "eval"
    ]


def load_rows(results: Path, peak_flops_override: float | None = None) -> list[dict]:
    """One row per run folder (a folder with ``status.json``), in run order."""
    if not results.is_dir():
        raise UsageError(f"results folder not found: {results}")
    folders = sorted(p for p in results.iterdir() if (p / "status.json").is_file())
    if not folders:
        raise UsageError(f"{results} holds no benchmark runs (folders with status.json)")
    order = _plan_order(results)
    folders.sort(key=lambda p: order.get(p.name, len(order)))
    return [_row(p, peak_flops_override) for p in folders]


def _plan_order(results: Path) -> dict[str, int]:
    plan = results / "sweep.json"
    if not plan.exists():
        return {}
    return {run_id: i for i, run_id in enumerate(json.loads(plan.read_text())["runs"])}


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def line_name(row: dict, reshard_values: set[str]) -> str:
    """A line in plots and tables: the strategy, with its reshard setting where several ran."""
    if len(reshard_values) > 1:
        return f"{row['strategy']} reshard={row['reshard']}"
    return row["strategy"]


def aggregate(rows: list[dict]) -> dict[tuple, dict]:
    """Repeats of a combination -> median and range of each measure, keyed by
    (model, precision, line, world size)."""
    ok = [r for r in rows if r["status"] == "ok"]
    groups: dict[tuple, list[dict]] = {}
    for r in ok:
        reshards = {x["reshard"] for x in ok if x["model"] == r["model"]}
        key = (r["model"], r["precision"], line_name(r, reshards), r["world_size"])
        groups.setdefault(key, []).append(r)
    measures = [
        "time_per_epoch_s",
        "step_time_s",
        "samples_per_s",
        "tokens_per_s",
        "mfu",
        "peak_memory_bytes_max",
        "sharded_state_bytes_max",
        "final_test_loss",
        "final_test_accuracy",
        "time_to_target_s",
        "steps_to_target",
        *PROFILE_COLUMNS,
    ]
    out = {}
    for key, group in groups.items():
        first = group[0]
        keys = ("mesh", "params_total", "label", "copies", "global_batch_size", "host_malloc")
        agg = {"n": len(group), **{k: first[k] for k in keys}}
        for m in measures:
            values = [g[m] for g in group if g[m] is not None and not _isnan(g[m])]
            if values:
                agg[m] = statistics.median(values)
                agg[m + ":min"], agg[m + ":max"] = min(values), max(values)
        out[key] = agg
    return out


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)
