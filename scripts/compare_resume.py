"""Resume at another layout against straight runs, step by step (docs/checkpointing.md).

    python scripts/compare_resume.py --source 4 --target 2 --save-at 15 --steps 30 -- \
        --model cnn --dataset synthetic --global-batch-size 32 --seed 3 --dropout 0

Runs ``fsdp2lab train`` four times in a scratch folder: straight on ``--source`` ranks (saving
at ``--save-at``), straight on ``--target`` ranks, and the resume of that checkpoint on
``--target`` ranks; then prints, per step after the save, the resumed run's loss difference to
both straight runs and the straight runs' difference to each other. Extra flags after ``--`` go
to every run (``--source-flags``/``--target-flags`` to one side only).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

EXACT = ["--mixed-precision", "fp32", "--log-every-steps", "1", "--progress", "off"]


def train(folder: Path, name: str, ranks: int, flags: list[str]) -> dict[int, float]:
    metrics = folder / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "fsdp2lab", "train", "--nproc-per-node", str(ranks), *flags]
    cmd += ["--metrics-file", str(metrics)]
    if ranks == 1:
        cmd += ["--strategy", "single"]
    print(f"$ {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=folder, check=True, capture_output=True)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["event"] == "step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=int, required=True, help="ranks of the saving run")
    parser.add_argument("--target", type=int, required=True, help="ranks of the resumed run")
    parser.add_argument("--save-at", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--source-flags", default="", help="flags for the source runs only")
    parser.add_argument("--target-flags", default="", help="flags for the target runs only")
    parser.add_argument("flags", nargs="*", help="fsdp2lab train flags for every run (after --)")
    args = parser.parse_args()
    common = [*EXACT, *args.flags, "--max-steps", str(args.steps)]
    src_flags = [*common, *shlex.split(args.source_flags)]
    tgt_flags = [*common, *shlex.split(args.target_flags)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        saving = ["--ckpt-dir", "ckpt", "--ckpt-every-steps", str(args.save_at)]
        source = train(folder, "source", args.source, [*src_flags, *saving])
        target = train(folder, "target", args.target, tgt_flags)
        resume = ["--resume", f"ckpt/step-{args.save_at}"]
        resumed = train(folder, "resumed", args.target, [*tgt_flags, *resume])
    print(f"{'step':>4}  {'resumed-target':>14}  {'resumed-source':>14}  {'source-target':>13}")
    for step in sorted(resumed):
        print(
            f"{step:>4}  {abs(resumed[step] - target[step]):14.1e}  "
            f"{abs(resumed[step] - source[step]):14.1e}  {abs(source[step] - target[step]):13.1e}"
        )


if __name__ == "__main__":
    main()
