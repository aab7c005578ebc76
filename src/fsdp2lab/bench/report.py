"""``fsdp2lab report RESULTS``: ``results.csv``, ``summary.md`` and PNG plots of a sweep.

Plots have world size on the x axis and one line per strategy (the median over repeats, with a bar
from the fastest to the slowest); one set of plots per model and precision.
"""

from __future__ import annotations

from pathlib import Path

from fsdp2lab.bench.results import PROFILE_COLUMNS, aggregate, eval_curve, load_rows, write_csv

MiB = 2**20
# (measure, axis label, scale, log y axis)
PLOTS = [
    ("time_per_epoch_s", "time per epoch (s)", 1.0, True),
    ("final_test_loss", "validation loss", 1.0, False),
    ("final_test_accuracy", "validation accuracy", 1.0, False),
    ("peak_memory_bytes_max", "peak memory per rank (MiB)", 1 / MiB, False),
    ("sharded_state_bytes_max", "sharded state per rank (MiB)", 1 / MiB, False),
    ("samples_per_s", "throughput (samples/s)", 1.0, False),
    ("scaling_efficiency", "scaling efficiency (vs the fastest 1-rank run)", 1.0, False),
    ("tokens_per_s", "throughput (tokens/s)", 1.0, False),
    ("mfu", "model FLOPs utilisation", 1.0, False),
]
_LEGACY = ("ddp", "fsdp1")


def _series(agg: dict, model: str, precision: str) -> dict[str, dict[int, dict]]:
    """line -> world size -> aggregated measures, with the scaling efficiency added: throughput
    over (ranks x the fastest run on the fewest ranks), one baseline for every line."""
    lines: dict[str, dict[int, dict]] = {}
    for (m, p, line, ws), values in agg.items():
        if (m, p) == (model, precision):
            lines.setdefault(line, {})[ws] = values
    base_ws = min(ws for points in lines.values() for ws in points)
    base = max(
        (p[base_ws].get("samples_per_s", 0) for p in lines.values() if base_ws in p), default=0
    )
    for points in lines.values():
        for ws, values in points.items():
            if base and "samples_per_s" in values:
                for suffix in ("", ":min", ":max"):
                    eff = values["samples_per_s" + suffix] / base * base_ws / ws
                    values["scaling_efficiency" + suffix] = eff
    return lines


def plot(agg: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    written = []
    out.mkdir(parents=True, exist_ok=True)
    for model, precision in sorted({(k[0], k[1]) for k in agg}):
        lines = _series(agg, model, precision)
        world_sizes = sorted({ws for points in lines.values() for ws in points})
        for measure, label, scale, log_y in PLOTS:
            if not any(measure in v for points in lines.values() for v in points.values()):
                continue
            fig, ax = plt.subplots(figsize=(6, 4))
            for line, points in sorted(lines.items()):
                xs = [ws for ws in sorted(points) if measure in points[ws]]
                ys = [points[ws][measure] * scale for ws in xs]
                lo = [
                    y - points[ws][measure + ":min"] * scale for ws, y in zip(xs, ys, strict=True)
                ]
                hi = [
                    points[ws][measure + ":max"] * scale - y for ws, y in zip(xs, ys, strict=True)
                ]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=line)
            ax.set_xscale("log", base=2)
            ax.set_xticks(world_sizes, [str(w) for w in world_sizes])
            ax.minorticks_off()
            if log_y:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
                ax.yaxis.set_minor_formatter(ticker.ScalarFormatter())
            ax.set_xlabel("world size (ranks)")
            ax.set_ylabel(label)
            ax.set_title(f"{model} ({precision}): {label}")
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = out / f"{model}-{precision}-{measure}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def _fmt_range(values: dict, key: str, scale: float = 1.0, digits: int = 1) -> str:
    if key not in values:
        return "-"
    mid, lo, hi = (values[key + s] * scale for s in ("", ":min", ":max"))
    text = f"{mid:.{digits}f}"
    return text + (f" ({lo:.{digits}f}-{hi:.{digits}f})" if values["n"] > 1 else "")


def _ratio(value: float | None, ref: float | None) -> str:
    return f"{value / ref:.2f}x" if value and ref else "-"


def summary_markdown(agg: dict, rows: list[dict]) -> str:
    """Tables per model and precision: step time (median, range over repeats), throughput,
    memory, and ratios to the fastest DDP or FSDP1 line (time) and to DDP (memory)."""
    parts = []
    for model, precision in sorted({(k[0], k[1]) for k in agg}):
        lines = _series(agg, model, precision)
        params = next(iter(next(iter(lines.values())).values()))["params_total"]
        parts.append(f"### {model}, {precision} ({params:,} parameters)\n")
        parts.append(
            "| strategy | ranks | mesh | runs | step time ms | samples/s | peak mem/rank MiB | "
            "state/rank MiB | time vs fastest ddp/fsdp1 | peak mem vs ddp | state vs ddp | "
            "test loss | accuracy |"
        )
        parts.append("|" + "---|" * 13)
        for ws in sorted({ws for points in lines.values() for ws in points}):
            here = {n: points[ws] for n, points in lines.items() if ws in points}
            legacy = [v.get("step_time_s") for v in here.values() if v["label"] in _LEGACY]
            best = min((t for t in legacy if t), default=None)
            ddp = next((v for v in here.values() if v["label"] == "ddp"), {})
            for line in sorted(lines):
                v = lines[line].get(ws)
                if v is None:
                    continue
                parts.append(
                    f"| {line} | {ws} | {v['mesh']} | {v['n']} | "
                    f"{_fmt_range(v, 'step_time_s', 1000)} | {_fmt_range(v, 'samples_per_s', 1, 0)} | "
                    f"{_fmt_range(v, 'peak_memory_bytes_max', 1 / MiB, 0)} | "
                    f"{_fmt_range(v, 'sharded_state_bytes_max', 1 / MiB, 2)} | "
                    f"{_ratio(v.get('step_time_s'), best)} | "
                    f"{_ratio(v.get('peak_memory_bytes_max'), ddp.get('peak_memory_bytes_max'))} | "
                    f"{_ratio(v.get('sharded_state_bytes_max'), ddp.get('sharded_state_bytes_max'))} | "
                    f"{v.get('final_test_loss', float('nan')):.4f} | "
                    f"{v.get('final_test_accuracy', float('nan')):.4f} |"
                )
        parts.append("")
    parts += _extra_tables(agg)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        parts.append("Failed runs: " + ", ".join(f"{r['run']} ({r['error']})" for r in failed))
    return "\n".join(parts) + "\n"


def _md_table(title: str, columns: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    return [
        f"### {title}\n",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(map(str, row)) + " |" for row in rows),
        "",
    ]


def _extra_tables(agg: dict) -> list[str]:
    """Throughput against compute only, time to the target accuracy, and where a step goes,
    where runs have them."""
    # (model, precision, ws, global batch, host malloc) -> the side-by-side line's throughput
    ceiling = {
        (m, p, ws, v["global_batch_size"], v.get("host_malloc")): v["samples_per_s"]
        for (m, p, _, ws), v in agg.items()
        if v.get("copies", 1) > 1 and "samples_per_s" in v
    }
    share = []
    for (model, precision, line, ws), v in sorted(agg.items()):
        ref = ceiling.get((model, precision, ws, v["global_batch_size"], v.get("host_malloc")))
        if ref and "samples_per_s" in v:
            share.append(
                [model, line, ws, v["global_batch_size"], _fmt_range(v, "samples_per_s", 1, 0)]
                + [f"{100 * v['samples_per_s'] / ref:.0f}%"]
            )
    reached = [
        [model, line, ws, v["n"], _fmt_range(v, "time_to_target_s")]
        + [_fmt_range(v, "steps_to_target", 1, 0), f"{v['final_test_accuracy']:.4f}"]
        for (model, _, line, ws), v in sorted(agg.items())
        if "time_to_target_s" in v
    ]
    profiled = [
        [model, line, ws, *(_fmt_range(v, c) for c in PROFILE_COLUMNS)]
        for (model, _, line, ws), v in sorted(agg.items())
        if "profile_step_ms" in v
    ]
    names = ["model", "strategy", "ranks"]
    parts = _md_table(
        "Throughput against compute only (side-by-side one-rank runs, same batch)",
        [*names, "global batch", "samples/s", "of compute-only"],
        share,
    )
    parts += _md_table(
        "Time to the target accuracy",
        [*names, "runs", "time to target s", "steps", "final accuracy"],
        reached,
    )
    parts += _md_table(
        "Where a step goes (`--profile`: rank 0's profiled step of median length, ms)",
        [*names, *(c.removeprefix("profile_").removesuffix("_ms") for c in PROFILE_COLUMNS)],
        profiled,
    )
    return parts


def plot_accuracy_vs_time(results: Path, rows: list[dict], out: Path) -> list[Path]:
    """Per model: test accuracy against training wall time, one line per run that evaluated
    more than once (``--eval-every-steps``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for model in sorted({r["model"] for r in rows if r["status"] == "ok"}):
        curves = [
            (r, eval_curve(results / r["run"]))
            for r in rows
            if r["model"] == model and r["status"] == "ok"
        ]
        curves = [(r, c) for r, c in curves if len(c) > 1]
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for r, curve in curves:
            label = f"{r['strategy']} ws{r['world_size']}" + (
                f" r{r['repeat']}" if r["repeat"] > 1 else ""
            )
            ax.plot([t for t, _ in curve], [a for _, a in curve], marker=".", label=label)
            if r["target_accuracy"]:
                ax.axhline(r["target_accuracy"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{model}: accuracy against wall time")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{model}-accuracy-vs-time.png"
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_report(results: Path, peak_flops: float | None = None) -> dict[str, object]:
    """Write ``results.csv``, ``summary.md`` and ``plots/*.png`` into the results folder."""
    rows = load_rows(results, peak_flops)
    write_csv(rows, results / "results.csv")
    agg = aggregate(rows)
    (results / "summary.md").write_text(
        summary_markdown(agg, rows) if agg else "No run succeeded.\n"
    )
    pngs = plot(agg, results / "plots") + plot_accuracy_vs_time(results, rows, results / "plots")
    return {
        "rows": rows,
        "csv": results / "results.csv",
        "summary": results / "summary.md",
        "plots": pngs,
    }
