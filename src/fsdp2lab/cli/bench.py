"""``fsdp2lab bench`` (run a sweep) and ``fsdp2lab report RESULTS`` (CSV, summary and plots)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from fsdp2lab import consent
from fsdp2lab.cli.common import guarded
from fsdp2lab.errors import UsageError


def _csv(kind: type):
    def parse(text: str) -> list:
        try:
            return [kind(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {kind.__name__}, got {text!r}"
            ) from None

    return parse


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="run a benchmark sweep (strategies x world sizes x models x precisions x reshard)",
        description="Run every combination of a sweep as its own `fsdp2lab train` job and collect "
        "its metrics in RESULTS/<run>/. Flags override the sweep file's axes; train flags after "
        "`--` apply to every run. Then writes the report (see `fsdp2lab report`).",
    )
    bench.add_argument(
        "--sweep", metavar="FILE.toml", help="sweep file (format: docs/fsdp1-vs-fsdp2.md)"
    )
    bench.add_argument("--out", default="bench-results", metavar="RESULTS", help="results folder")
    bench.add_argument("--strategies", type=_csv(str), help="e.g. ddp,fsdp1,fsdp2,hsdp")
    bench.add_argument("--world-sizes", type=_csv(int), help="e.g. 1,2,4")
    bench.add_argument("--models", type=_csv(str), help="e.g. cnn,gpt")
    bench.add_argument("--precisions", type=_csv(str), help="e.g. fp32,bf16")
    bench.add_argument(
        "--reshard", type=_csv(str), help="--reshard-after-forward values, e.g. true,false"
    )
    bench.add_argument("--repeat", type=int, help="runs of each combination (default 1)")
    bench.add_argument(
        "--launcher",
        choices=("auto", "local", "srun"),
        default="auto",
        help="local workers, or srun inside a Slurm allocation (auto: srun when SLURM_JOB_ID is set)",
    )
    bench.add_argument(
        "--srun-args", default="", help="extra srun arguments, e.g. '--gpus-per-task=1'"
    )
    bench.add_argument("--timeout-s", type=float, help="end a run after this many seconds (failed)")
    bench.add_argument(
        "--threads-per-rank",
        type=int,
        help="OMP_NUM_THREADS of every rank (CPU runs: 1 makes a rank one core, as a GPU is one)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="each run writes a profiler trace to RESULTS/<run>/profile (train --profile); the "
        "report adds where a step goes",
    )
    bench.add_argument("--resume", action="store_true", help="keep runs of RESULTS that succeeded")
    bench.add_argument("--allow-code", action="store_true", help=consent.ALLOW_CODE_HELP)
    bench.add_argument("--allow-paths", action="store_true", help=consent.ALLOW_PATHS_HELP)
    bench.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    bench.add_argument(
        "--no-report", action="store_true", help="do not write the report at the end"
    )
    bench.add_argument("train_args", nargs=argparse.REMAINDER, help="-- TRAIN FLAGS for every run")
    bench.set_defaults(func=guarded(cmd_bench))

    report = subparsers.add_parser(
        "report",
        help="results.csv, summary.md and PNG plots of a bench results folder; or the loss "
        "curves of several runs in one plot",
        description="With a bench results folder: write RESULTS/results.csv (one row per run), "
        "RESULTS/summary.md (tables with ratios) and RESULTS/plots/*.png (one line per strategy "
        "against world size). With runs (metrics files, TensorBoard log folders, bench run "
        "folders): overlay their loss curves against step and wall time in --out.",
    )
    report.add_argument(
        "results",
        metavar="RESULTS|RUN",
        nargs="+",
        help="folder written by `fsdp2lab bench`, or runs to overlay",
    )
    report.add_argument(
        "--out",
        default="loss-curves.png",
        metavar="FILE.png",
        help="runs: the plot to write (default: loss-curves.png)",
    )
    report.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's peak TFLOP/s for model FLOPs utilisation (default: by GPU name)",
    )
    report.set_defaults(func=guarded(cmd_report))


def train_flag_values(train_args: list[str]) -> dict:
    """``-- --max-steps 20 ...`` -> train keys, parsed and checked as ``fsdp2lab train`` does."""
    from fsdp2lab.bench.sweep import check_train_keys
    from fsdp2lab.config import add_train_arguments

    args = train_args[1:] if train_args[:1] == ["--"] else train_args
    if not args:
        return {}
    parser = argparse.ArgumentParser(prog="fsdp2lab bench ... --", add_help=False)
    add_train_arguments(parser)
    try:
        namespace, unknown = parser.parse_known_args(args)
    except SystemExit:
        raise UsageError(f"bench: bad train flags after --: {' '.join(args)}") from None
    if unknown:
        raise UsageError(f"bench: unknown train flags after --: {' '.join(unknown)}")
    if namespace.config:
        raise UsageError("bench: put train keys in the sweep file's [train] table, not --config")
    for flag in ("allow_code", "allow_paths"):
        if getattr(namespace, flag):
            name = "--" + flag.replace("_", "-")
            raise UsageError(f"bench: {name} goes before --, as a bench flag")
    own = ("config", "allow_code", "allow_paths")
    values = {k: v for k, v in vars(namespace).items() if v is not None and k not in own}
    return check_train_keys(values, "bench: train flags")


def cmd_bench(args: argparse.Namespace) -> int:
    from fsdp2lab.bench import runner, sweep
    from fsdp2lab.bench.report import write_report
    from fsdp2lab.config import CODE_KEYS, OUTPUT_PATH_KEYS

    typed = train_flag_values(args.train_args)
    # What the user typed is theirs: the references and paths of its flags, and --models.
    consent.register(
        allow_code=args.allow_code,
        allow_paths=args.allow_paths,
        typed=[
            *((k, v) for k, v in typed.items() if k in (*CODE_KEYS, *OUTPUT_PATH_KEYS)),
            *(("model", name) for name in args.models or []),
        ],
    )
    spec = sweep.load_sweep(args.sweep)
    spec = sweep.override(
        spec,
        strategies=args.strategies,
        world_sizes=args.world_sizes,
        models=args.models,
        precisions=args.precisions,
        reshard=args.reshard,
        repeat=args.repeat,
    )
    for name in ("repeat", "threads_per_rank", "timeout_s"):
        value = spec.repeat if name == "repeat" else getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    spec.train = {**spec.train, **typed}
    runs, skipped = sweep.plan(spec)
    launcher = runner.pick_launcher(args.launcher)
    out = Path(args.out)
    print(f"fsdp2lab bench: {len(runs)} runs into {out} (launcher: {launcher})", flush=True)
    for reason in skipped:
        print(f"  left out: {reason}", flush=True)
    if args.dry_run:
        for run in runs:
            print(f"  {run.run_id}")
        return 0
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise UsageError(f"{out} is not empty: choose a new --out, or --resume to continue it")
    out.mkdir(parents=True, exist_ok=True)
    plan = {"sweep": asdict(spec), "runs": [r.run_id for r in runs], "left_out": skipped}
    (out / "sweep.json").write_text(json.dumps(plan, indent=1) + "\n")
    try:
        statuses = runner.run_sweep(
            runs,
            out,
            launcher=launcher,
            timeout_s=args.timeout_s,
            srun_args=args.srun_args,
            resume=args.resume,
            threads_per_rank=args.threads_per_rank,
            profile=args.profile,
            allow_code=args.allow_code,
            allow_paths=args.allow_paths,
        )
    except runner.Interrupted as stop:
        print(f"fsdp2lab bench: stopped by {stop}; continue with --resume", file=sys.stderr)
        return 130
    failed = [s for s in statuses if not s["ok"]]
    if not args.no_report and len(failed) < len(statuses):
        _print_report(write_report(out))
    if failed:
        print(
            f"fsdp2lab bench: {len(failed)} of {len(statuses)} runs failed: "
            + ", ".join(s["run_id"] for s in failed)
            + f" (logs in {out}/<run>/stderr.log)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def _print_report(written: dict) -> None:
    print(f"wrote {written['csv']} ({len(written['rows'])} runs), {written['summary']}")
    for path in written["plots"]:
        print(f"wrote {path}")


def _isguarded(path: Path) -> bool:
    """A metrics file, event file, or folder of either (else: a bench results folder)."""
    if path.is_dir():
        return (path / "metrics.jsonl").is_file() or any(path.glob("events.out.tfevents*"))
    return path.is_file()


def cmd_report(args: argparse.Namespace) -> int:
    from fsdp2lab.bench.report import write_report

    if len(args.results) == 1 and not _isguarded(Path(args.results[0])):
        peak = args.peak_tflops * 1e12 if args.peak_tflops else None
        _print_report(write_report(Path(args.results[0]), peak))
        return 0
    from fsdp2lab.bench.curves import plot_curves

    print(f"wrote {plot_curves(args.results, Path(args.out))}")
    return 0
