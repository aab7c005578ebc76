"""The CPU step's speed in one command: the gpt's time per step under DDP, FSDP2 (its default, one
unit per layer: per block) and FSDP2 with its layers grouped (``--fsdp-units auto``) on 2 ranks,
their ratios to DDP, and the main job's time to 90% against the seed tutorial's script
(scripts/seed_fsdp_mnist.py) on the same Fashion-MNIST files.

Runs are interleaved with the repeats outermost, so load that comes and goes falls on every variant
alike; each figure is the median of the repeats with their range, each ratio the median of the
per-repeat ratios. Time per step is the median between the metrics file's step records (bench's
``step_time``), else the last epoch's time over its steps.

    PYTHONPATH=src python scripts/cpu_speed.py              # 18 minutes on a quiet 2-core machine
    PYTHONPATH=src python scripts/cpu_speed.py --no-to-90   # the gpt part only
    git worktree add ../old COMMIT && PYTHONPATH=src python scripts/cpu_speed.py --no-to-90 \
        --against ../old/src                                # this tree and COMMIT, interleaved
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp2lab.bench.results import read_metrics, step_time

SEED_SCRIPT = Path(__file__).resolve().parent / "seed_fsdp_mnist.py"
VARIANTS = {
    "ddp": ["--strategy", "ddp"],
    "fsdp2": ["--strategy", "fsdp2"],
    "fsdp2-auto": ["--strategy", "fsdp2", "--fsdp-units", "auto"],
}


def _run(cmd: list[str], src: Path | None = None) -> str:
    """``cmd``'s output; with ``src``, fsdp2lab imported from that checkout's src/."""
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"cpu_speed: failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return proc.stdout


def gpt_step_s(args: argparse.Namespace, variant: str, work: Path, src: Path | None) -> float:
    metrics = work / f"{variant}.jsonl"
    metrics.unlink(missing_ok=True)
    _run([sys.executable, "-m", "fsdp2lab", "train", "--model", "gpt", "--dataset", "synthetic",
          "--max-steps", str(args.steps), "--global-batch-size", "16", "--seq-len", "128",
          "--d-model", str(args.d_model), "--n-heads", "8", "--n-layers", str(args.n_layers),
          "--nproc-per-node", "2", "--progress", "off", "--log-every-steps", str(args.log_every),
          "--metrics-file", str(metrics), *VARIANTS[variant]], src)  # fmt: skip
    records = read_metrics(metrics)
    last = [r for r in records if r["event"] == "epoch"][-1]
    return step_time(records) or last["train_time_s"] / max(last["steps"], 1)


def main_job_to_target_s(args: argparse.Namespace, work: Path) -> float:
    metrics = work / "main.jsonl"
    metrics.unlink(missing_ok=True)
    _run([sys.executable, "-m", "fsdp2lab", "train", "--dataset", "fashion-mnist",
          "--target-accuracy", str(args.target), "--progress", "off",
          "--metrics-file", str(metrics), *args.main_args])  # fmt: skip
    reached = [r for r in read_metrics(metrics) if r["event"] == "target_reached"]
    if not reached:
        sys.exit(f"cpu_speed: the main job did not reach {args.target}%")
    return reached[0]["elapsed_s"]


def seed_to_target_s(args: argparse.Namespace, work: Path) -> float:
    out = _run([sys.executable, str(SEED_SCRIPT), "--dataset", "fashion-mnist",
                "--target-accuracy", str(args.target), "--data-dir", str(work / "seed-data"),
                *args.seed_args])  # fmt: skip
    found = re.search(r"^Time to \S+%: (\d+\.\d)s", out, re.M)
    if not found:
        sys.exit(f"cpu_speed: the seed script did not reach {args.target}%")
    return float(found[1])


def _median_range(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return (
        f"{statistics.median(values) * scale:.{digits}f} "
        f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="gpt optimizer steps a run")
    parser.add_argument("--log-every", type=int, default=10, help="steps between step records")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--no-gpt", dest="gpt", action="store_false", help="skip the gpt part")
    parser.add_argument("--no-to-90", dest="to_target", action="store_false",
                        help="skip the main job against the seed script")  # fmt: skip
    parser.add_argument("--target", type=float, default=90, metavar="PERCENT")
    parser.add_argument("--main-args", type=shlex.split, default=[], help="more flags, one string")
    parser.add_argument("--seed-args", type=shlex.split, default=[], help="the seed's, one string")
    parser.add_argument("--against", type=Path, metavar="SRC",
                        help="another checkout's src/ (a git worktree of another commit): its "
                        "gpt variants run interleaved with these, each against its own DDP")  # fmt: skip
    args = parser.parse_args()

    trees = {"": None}  # label -> the src/ fsdp2lab is imported from (None: this environment's)
    if args.against is not None:
        trees[f" @{args.against.resolve().parent.name}"] = args.against.resolve()
    gpt: dict[str, list[float]] = {name + tree: [] for tree in trees for name in VARIANTS}
    main_s: list[float] = []
    seed_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for tree, src in trees.items() if args.gpt else ():
                for name in VARIANTS:
                    gpt[name + tree].append(gpt_step_s(args, name, work, src))
                    print(f"repeat {repeat + 1}: gpt {name + tree} "
                          f"{gpt[name + tree][-1] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)  # fmt: skip
            if args.to_target:
                main_s.append(main_job_to_target_s(args, work))
                seed_s.append(seed_to_target_s(args, work))
                print(f"repeat {repeat + 1}: to {args.target:g}% {main_s[-1]:.1f} s, seed "
                      f"{seed_s[-1]:.1f} s", file=sys.stderr, flush=True)  # fmt: skip

    print(f"medians of {args.repeats} (range), runs interleaved")
    if args.gpt:
        print(f"gpt L{args.n_layers} d{args.d_model}, 2 ranks, {args.steps} steps: ms per step")
        for name, values in gpt.items():
            print(f"  {name:<14} {_median_range(values, 1e3)}")
        for tree in trees:
            for name in [name for name in VARIANTS if name != "ddp"]:
                ratios = [a / b for a, b in zip(gpt[name + tree], gpt["ddp" + tree], strict=True)]
                print(f"  {name + '/ddp' + tree:<14} {_median_range(ratios, digits=3)}")
    if args.to_target:
        ratios = [a / b for a, b in zip(main_s, seed_s, strict=True)]
        print(f"time to {args.target:g}% on Fashion-MNIST: s")
        print(f"  {'fsdp2lab':<14} {_median_range(main_s)}")
        print(f"  {'seed':<14} {_median_range(seed_s)}")
        print(f"  {'ratio':<14} {_median_range(ratios, digits=3)}")


if __name__ == "__main__":
    main()
