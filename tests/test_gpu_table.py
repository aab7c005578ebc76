"""scripts/gpu_table.py (docs/speed.md's GPU table) on the CPU at a tiny size: one row of each kind
(a ``fsdp2lab train`` run, QLoRA's, profiled; the plain loop with both optimizers; the plan) in the
table, the JSON file the GPU stage's checks read (tests/test_gpu.py runs it on a GPU) and the
kernel tables of ``--profile``; which step records a row's tokens/s takes at each cadence;
scripts/gpu_kernels.py's kernel table, on a trace shaped as a CUDA one, and its run on the CPU."""

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
TINY = ["--hidden", "128", "--intermediate", "256", "--layers", "2", "--heads", "4",
        "--kv-heads", "4", "--vocab", "512", "--seq-len", "32", "--batch-size", "2",
        "--synthetic-size", "32", "--steps", "12", "--warmup", "10"]  # fmt: skip
ROWS = ["qlora", "plain", "plain-fused", "plan"]
sys.path.insert(0, str(SCRIPT.parent))
import gpu_table  # noqa: E402


def test_gpu_table_runs_each_kind_of_row_on_cpu(tmp_path):
    pytest.importorskip("torchao")  # the qlora row (the hf stage installs it)
    pytest.importorskip("peft")
    out, prof = tmp_path / "rows.json", tmp_path / "prof"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--rows", ",".join(ROWS), *TINY,
           "--json", str(out), "--profile", str(prof)]  # fmt: skip
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
    assert len(lines) == 2 + len(ROWS)
    assert lines[2].startswith(f"| {gpu_table.LABELS['qlora']} | ")
    (head,) = [ln for ln in (prof / "kernels.txt").read_text().splitlines() if ln.startswith("===")]
    assert head.startswith(f"=== {gpu_table.LABELS['qlora']}: 3 steps; a step: host ")
    assert (prof / "qlora" / "rank0.pt.trace.json").is_file()


def test_gpu_table_refuses_an_unknown_row():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", "fsdp3"], capture_output=True,
                          text=True, env=cli_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "unknown rows ['fsdp3']" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rows", "fsdp2-log10", "--steps", "20", "--warmup", "11"],
         "a step record every 10 steps leaves none after --warmup 11 in --steps 20"),
        (["--rows", "fsdp2", "--profile", "p", "--warmup", "9"],
         "--profile records steps 7-9 and writes its trace in step 10's time: --warmup must "
         "be at least 10"),
    ],
)  # fmt: skip
def test_gpu_table_refuses_a_warm_up_that_leaves_no_record_or_overlaps_the_profile(
    flags, message, capsys
):
    with pytest.raises(SystemExit) as exit_:
        gpu_table.main(flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_gpu_table_refuses_the_qlora_row_without_torchao(monkeypatch, capsys):
    monkeypatch.setattr(gpu_table.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        gpu_table.main(["--rows", "lora,qlora"])
    assert exit_.value.code == 2
    assert "the qlora row needs torchao: pip install -e '.[qlora]'" in capsys.readouterr().err


def test_gpu_table_takes_the_records_whose_window_follows_the_warm_up():
    every_step = [{"step": s, "tokens_per_s": float(s)} for s in range(1, 31)]
    assert gpu_table.steady_rates(every_step, 10) == [float(s) for s in range(11, 31)]
    # every 10 steps: the record at step 10 holds steps 1-10, inside the warm-up
    every_10 = [{"step": s, "tokens_per_s": float(s)} for s in (10, 20, 25)]  # 25: --max-steps
    assert gpu_table.steady_rates(every_10, 10) == [20.0, 25.0]
    assert gpu_table.steady_rates(every_10, 8) == [20.0, 25.0]
    assert gpu_table.steady_rates(every_10, 0) == [10.0, 20.0, 25.0]


def test_gpu_kernels_tables_a_cuda_traces_kernels_once_a_step(tmp_path):
    """scripts/gpu_kernels.py's table, on a trace shaped as torch writes a CUDA one: each
    ProfilerStep on the host thread and again on the GPU's lane; kernels overlapping."""
    import gpu_kernels

    events = []
    for step in range(2):
        t0 = 1000.0 * step
        for cat in ("user_annotation", "gpu_user_annotation"):
            events.append({"name": f"ProfilerStep#{step}", "cat": cat, "ts": t0, "dur": 900.0})
        events += [
            {"name": "gemm", "cat": "kernel", "ts": t0 + 10, "dur": 300.0},
            # the second overlaps the first by 110 us: the GPU is busy 490 + 50 us a step
            {"name": "gemm", "cat": "kernel", "ts": t0 + 200, "dur": 300.0},
            {"name": "Memcpy DtoD", "cat": "gpu_memcpy", "ts": t0 + 600, "dur": 50.0},
            {"name": "aten::mm", "cat": "cpu_op", "ts": t0 + 5, "dur": 20.0},
        ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    lines = gpu_kernels.kernel_table(trace, "x").splitlines()
    assert lines[0] == ("=== x: 2 steps; a step: host 0.90 ms, 3 kernels, kernel time 0.65 ms, "
                        "GPU busy 0.54 ms")  # fmt: skip
    assert lines[1].split() == ["0.600", "ms", "2.0x", "kern", "gemm"]
    assert lines[2].split() == ["0.050", "ms", "1.0x", "gpu_", "Memcpy", "DtoD"]


def test_gpu_kernels_runs_on_cpu(tmp_path):
    script = SCRIPT.parent / "gpu_kernels.py"
    out = tmp_path / "kernels.txt"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "1",
                           "--out", str(out)], capture_output=True, text=True, env=cli_env(),
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    heads = [line for line in out.read_text().splitlines() if line.startswith("===")]
    labels = ["fsdp2lab fsdp2", "fsdp2lab lora", "plain loop, AdamW fused"]
    assert [h.split(":")[0].removeprefix("=== ") for h in heads] == labels
    assert all(": 3 steps; a step: host " in h for h in heads), heads
