"""The tools in scripts/ that the docs tell users to run, run here on small settings; each output
is checked for what the docs read from it. (local-slurm.sh and multinode-torchrun.sh: test_slurm.py,
test_multinode.py, test_two_hosts.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FASHION_DIR, cli_env

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_every_script_is_tested_here_or_named_by_a_test():
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    untested = [p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")]
    assert untested and all(name in tests for name in untested), untested


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=cli_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_ac_memory_table_shows_full_checkpointing_saving_the_least():
    out = _run(str(SCRIPTS / "ac_memory.py"), "--seq", "64", "--d-model", "64", "--heads", "2",
               "--layers", "4", "--batch", "4", "--repeats", "1")  # fmt: skip
    rows = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in out.splitlines()[2:]
        if line.strip()
    }
    assert list(rows) == ["none", "full", "selective", "op"], out
    saved = {mode: values[0] for mode, values in rows.items()}
    # Full recomputes every block and keeps only its input; selective every other block; op keeps
    # every block's attention and every other matmul, recomputes the rest.
    assert saved["full"] < saved["selective"] < saved["none"], out
    assert saved["full"] < saved["op"] < saved["none"], out
    assert all(values[1] > 0 for values in rows.values()), out  # a peak was measured


def test_compare_resume_prints_each_step_after_the_save():
    out = _run(str(SCRIPTS / "compare_resume.py"), "--source", "2", "--target", "1",
               "--save-at", "4", "--steps", "8", "--", "--model", "mlp", "--dataset",
               "synthetic", "--synthetic-size", "512", "--dropout", "0",
               "--global-batch-size", "32")  # fmt: skip
    lines = out.splitlines()
    assert lines[0].split() == ["step", "resumed-target", "resumed-source", "source-target"]
    rows = [line.split() for line in lines[1:]]
    assert [int(r[0]) for r in rows] == [5, 6, 7, 8], out
    # fp32: the resumed run follows the straight runs as closely as they follow each other.
    for _, to_target, _, between in rows:
        assert float(to_target) <= max(10 * float(between), 1e-6), out


def test_seed_fsdp1_script_trains_an_epoch_and_times_the_target(tmp_path):
    """The baseline of docs/speed.md's time-to-90% table: the seed's lines, and its timer (an
    epoch of a fifth of the training set: the lines are the same, the test set whole)."""
    if not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file():
        reason = "needs Debian's dataset-fashion-mnist (.ci/run installs it)"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    out = _run(str(SCRIPTS / "seed_fsdp_mnist.py"), "--dataset", "fashion-mnist", "--epochs", "1",
               "--target-accuracy", "50", "--train-samples", "12000",
               "--data-dir", str(tmp_path))  # fmt: skip
    assert re.search(r"^Train Epoch: 1 \tLoss: \d+\.\d{6}$", out, re.M), out
    accuracy = re.search(
        r"^Test set: Average loss: \d+\.\d{4}, Accuracy: \d+/10000 \((\S+)%\)$", out, re.M
    )
    assert accuracy and float(accuracy[1]) >= 50, out
    assert re.search(r"^Time to 50%: \d+\.\ds \(epoch 1\)$", out, re.M), out


def test_cpu_time_check_prints_the_plan_beside_the_real_step(tmp_path):
    row = "gpt L8 d32 b2 s16"
    out = _run(str(SCRIPTS / "cpu_time_check.py"), "--rows", row, "--repeats", "1",
               "--steps", "4", "--warmup", "2", "--json", str(tmp_path / "t.json"))  # fmt: skip
    number = r"[\d.]+ \S+ \([\d.]+-[\d.]+\)"  # the median of the rounds (their range)
    assert re.search(f"fp32 matmul {number}, copy {number}, one op {number}", out), out
    (line,) = [line for line in out.splitlines() if line.startswith(f"| {row} |")]
    result = json.loads((tmp_path / "t.json").read_text())
    plan = result["plan"][row]
    parts = ("matmul", "attention", "memory", "launch", "other")
    assert plan["step"] == pytest.approx(sum(plan[k] for k in parts))  # nothing overlaps
    assert plan["launch"] > 0 and result["real_step_ms"][row][0] > 0, line
    assert result["profiled"][row]["step"] > 0, line


@pytest.mark.slow  # six 2-rank launches
def test_cpu_speed_prints_the_ratios_to_ddp():
    """scripts/cpu_speed.py at a tiny size: each strategy's time per step and the ratios to DDP."""
    src = SCRIPTS.parent / "src"  # --against: another checkout's (here this one's) interleaved
    out = _run(str(SCRIPTS / "cpu_speed.py"), "--repeats", "1", "--steps", "4", "--log-every",
               "1", "--d-model", "32", "--n-layers", "2", "--no-to-90", "--against", str(src))  # fmt: skip
    for tree in ("", f" @{src.parent.name}"):
        for name in ("ddp", "fsdp2", "fsdp2-auto"):
            assert re.search(rf"^  {name}{tree} +[\d.]+ \([\d.]+-[\d.]+\)$", out, re.M), out
        for name in ("fsdp2", "fsdp2-auto"):
            assert re.search(rf"^  {name}/ddp{tree} +\d\.\d{{3}} \(", out, re.M), out
