"""scripts/gpu_table.py (docs/speed.md's GPU table) on the CPU at a tiny size: one row of each kind
(a ``fsdp2lab train`` run, the plain loop with both optimizers, the plan) in the table and the JSON
file the GPU stage's checks read (tests/test_gpu.py runs it on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

pytestmark = [pytest.mark.slow, pytest.mark.hf]  # hf: builds the model with transformers
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_table.py"
TINY = ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--vocab", "512", "--seq-len", "32", "--batch-size", "2",
        "--synthetic-size", "32", "--steps", "6", "--warmup", "2"]  # fmt: skip
ROWS = ["fsdp2", "plain", "plain-fused", "plan"]


def test_gpu_table_runs_each_kind_of_row_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--rows", ",".join(ROWS), *TINY,
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert list(rows) == ROWS
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and row["peak_allocated_bytes"] > 0, (name, row)
        assert row["mfu"] is None  # no peak FLOP/s for a CPU
    assert rows["plan"]["peak_reserved_bytes"] >= rows["plan"]["peak_allocated_bytes"]
    lines = proc.stdout.splitlines()
    assert lines[0] == "| row | tokens/s | MFU | peak allocated GiB | peak reserved GiB |"
    assert len(lines) == 2 + len(ROWS) and lines[2].startswith("| fsdp2lab FSDP2, 1 rank | ")


def test_gpu_table_refuses_an_unknown_row():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", "fsdp3"], capture_output=True,
                          text=True, env=cli_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "unknown rows ['fsdp3']" in proc.stderr
