"""``fsdp2lab bench`` and ``fsdp2lab report``: a tiny real sweep, failures inside a sweep, and
bad sweep files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from conftest import run_cli
from fsdp2lab import cli
from fsdp2lab.bench import runner
from fsdp2lab.bench.results import COLUMNS
from fsdp2lab.bench.sweep import RunSpec

TINY_SWEEP = """
[sweep]
strategies = ["single", "fsdp2", "broken"]
world_sizes = [1, 2]
models = ["gpt"]

[train]
dataset = "synthetic"
synthetic_size = 256
global_batch_size = 16
max_steps = 6
log_every_steps = 2
dropout = 0.0

[models.gpt]
n_layers = 2
d_model = 32
n_heads = 4
seq_len = 16

[variants.broken]   # a dataset that is not there: fails in the run, after planning
strategy = "fsdp2"
dataset = "text"
text_file = "missing.txt"
"""
PLOTS = [
    "time_per_epoch_s",
    "final_test_loss",
    "final_test_accuracy",
    "peak_memory_bytes_max",
    "sharded_state_bytes_max",
    "samples_per_s",
    "scaling_efficiency",
    "tokens_per_s",
]


@pytest.mark.slow  # five launches: a minute
def test_tiny_sweep_writes_the_csv_every_plot_and_records_a_failed_run(tmp_path):
    (tmp_path / "sweep.toml").write_text(TINY_SWEEP)
    proc = run_cli(["bench", "--sweep", "sweep.toml", "--out", "res"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some runs failed
    out = proc.stdout
    for run in ("gpt-single-ws1-fp32", "gpt-fsdp2-ws1-fp32", "gpt-fsdp2-ws2-fp32"):
        assert f"{run} ... ok" in out, out
    assert "left out: gpt-single-ws2-fp32" in out
    # The failed runs are recorded, and the sweep went on past them to the report.
    assert "gpt-broken-ws1-fp32 ... FAILED (exit 2)" in out and "missing.txt" in out
    assert "2 of 5 runs failed: gpt-broken-ws1-fp32, gpt-broken-ws2-fp32" in proc.stderr
    res = tmp_path / "res"
    status = json.loads((res / "gpt-broken-ws2-fp32" / "status.json").read_text())
    assert status["ok"] is False and status["returncode"] == 2 and "missing.txt" in status["error"]

    rows = list(csv.DictReader((res / "results.csv").open()))
    assert list(rows[0]) == COLUMNS
    assert [r["run"] for r in rows] == [
        "gpt-single-ws1-fp32",
        "gpt-fsdp2-ws1-fp32",
        "gpt-fsdp2-ws2-fp32",
        "gpt-broken-ws1-fp32",
        "gpt-broken-ws2-fp32",
    ]
    by_run = {r["run"]: r for r in rows}
    assert by_run["gpt-broken-ws1-fp32"]["status"] == "failed"
    fsdp2 = by_run["gpt-fsdp2-ws2-fp32"]
    assert fsdp2["status"] == "ok" and fsdp2["mesh"] == "dp_shard=2" and fsdp2["world_size"] == "2"
    assert float(fsdp2["tokens_per_s"]) == pytest.approx(float(fsdp2["samples_per_s"]) * 16)
    assert fsdp2["mfu"] == ""  # only on GPUs
    assert len(fsdp2["sharded_state_bytes_per_rank"].split(";")) == 2
    # Sharded over 2 ranks: half of what one process holds (within FSDP's padding).
    single = by_run["gpt-single-ws1-fp32"]
    assert int(fsdp2["sharded_state_bytes_max"]) == pytest.approx(
        int(single["sharded_state_bytes_max"]) / 2, rel=0.03
    )
    assert float(fsdp2["final_test_loss"]) == pytest.approx(
        float(single["final_test_loss"]), abs=1e-5
    )
    for name in PLOTS:
        png = res / "plots" / f"gpt-fp32-{name}.png"
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG", name
    summary = (res / "summary.md").read_text()
    assert "| fsdp2 | 2 | dp_shard=2 | 1 |" in summary and "Failed runs: gpt-broken" in summary

    # `report` regenerates the same files from the folder alone.
    (res / "results.csv").unlink()
    assert cli.main(["report", str(res)]) == 0
    assert list(csv.DictReader((res / "results.csv").open())) == rows

    # A non-empty results folder is kept unless --resume, which keeps the runs that succeeded.
    again = run_cli(["bench", "--sweep", "sweep.toml", "--out", "res"], cwd=tmp_path)
    assert again.returncode == 2 and "res is not empty" in again.stderr
    resumed = run_cli(["bench", "--sweep", "sweep.toml", "--out", "res", "--resume"], cwd=tmp_path)
    assert resumed.returncode == 1
    assert "gpt-fsdp2-ws2-fp32: done before, kept" in resumed.stdout
    assert "gpt-broken-ws2-fp32 ... FAILED" in resumed.stdout


def _bench(capsys, tmp_path: Path, sweep: str | None, *flags: str) -> tuple[int, str]:
    args = ["bench", "--out", str(tmp_path / "res"), "--dry-run", *flags]
    if sweep is not None:
        (tmp_path / "s.toml").write_text(sweep)
        args += ["--sweep", str(tmp_path / "s.toml")]
    try:
        code = cli.main(args)
    except SystemExit as e:  # argparse
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    "sweep, flags, message",
    [
        ("[sweep]\nstrategies = [\n", [], "is not valid TOML"),
        ("[swep]\n", [], "unknown table [swep]"),
        ("[sweep]\nworld_size = [2]\n", [], "[sweep] unknown key 'world_size'"),
        ("[sweep]\nworld_sizes = 2\n", [], "world_sizes must be a non-empty list, got 2"),
        ('[sweep]\nworld_sizes = ["2"]\n', [], "world_sizes must hold int values, got '2'"),
        ("[sweep]\nrepeat = 0\n", [], "repeat must be an integer >= 1"),
        ('[sweep]\nstrategies = ["zero3"]\n', [], "unknown strategy 'zero3'"),
        ('[sweep]\nmodels = ["resnet"]\n', [], "unknown model 'resnet'"),
        ('[sweep]\nprecisions = ["fp8"]\n', [], "unknown precision 'fp8'"),
        ('[sweep]\nreshard = ["sometimes"]\n', [], "--reshard-after-forward must be true, false"),
        ("[train]\nmax_step = 5\n", [], "[train]: unknown key 'max_step'"),
        ('[train]\nmax_steps = "5"\n', [], "[train]: max_steps must be int"),
        ('[train]\nmodel = "gpt"\n', [], "model is set by the sweep's axes"),
        ('[train]\nckpt_dir = "c"\n', [], "ckpt_dir would be one file for every run"),
        ("[variants.x]\nfsdp_units = 3\n", [], "[variants.x]: fsdp_units must be str"),
        ('[sweep]\nstrategies = ["single"]\nworld_sizes = [2]\n', [], "no combination"),
        (None, ["--world-sizes", "1,two"], "comma-separated list of int"),
        (None, ["--", "--max-stepz", "3"], "unknown train flags after --: --max-stepz 3"),
        (None, ["--repeat", "0"], "--repeat must be > 0"),
    ],
)
def test_bad_sweeps_are_one_clear_error(capsys, tmp_path, sweep, flags, message):
    code, output = _bench(capsys, tmp_path, sweep, *flags)
    assert code == 2 and message in output and "Traceback" not in output, output


def test_missing_sweep_file_and_results_folder(capsys, tmp_path):
    code, output = _bench(capsys, tmp_path, None, "--sweep", str(tmp_path / "nope.toml"))
    assert code == 2 and "sweep file not found" in output
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2
    assert "results folder not found" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "holds no benchmark runs" in capsys.readouterr().err


def test_plan_flags_override_the_file_and_leave_out_what_cannot_run(capsys, tmp_path):
    sweep = '[sweep]\nstrategies = ["ddp"]\nmodels = ["cnn"]\n'
    code, output = _bench(
        capsys,
        tmp_path,
        sweep,
        "--strategies",
        "single,hsdp",
        "--world-sizes",
        "1,2,4",
        "--repeat",
        "2",
    )
    assert code == 0, output
    assert "fsdp2lab bench: 6 runs" in output  # single on 1, hsdp on 2 and 4; twice each
    assert "left out: cnn-single-ws2-fp32: --strategy single runs in one process" in output
    assert "left out: cnn-hsdp-ws1-fp32: mesh does not fit" in output
    runs = [line.strip() for line in output.splitlines() if line.startswith("  cnn-")]
    # Repeats outermost: load that comes and goes falls on every combination alike.
    assert runs == [
        "cnn-single-ws1-fp32-r1",
        "cnn-hsdp-ws2-fp32-r1",
        "cnn-hsdp-ws4-fp32-r1",
        "cnn-single-ws1-fp32-r2",
        "cnn-hsdp-ws2-fp32-r2",
        "cnn-hsdp-ws4-fp32-r2",
    ]


def test_flags_also_replace_a_models_own_axes(capsys, tmp_path):
    sweep = (
        '[sweep]\nstrategies = ["ddp"]\nmodels = ["cnn", "own"]\n'
        '[models.own]\nmodel = "mlp"\nstrategies = ["compute-only", "fsdp2"]\n'
        "world_sizes = [2]\nrepeat = 1\n"
    )
    code, output = _bench(capsys, tmp_path, sweep, "--world-sizes", "4")
    assert code == 0, output
    runs = [line.strip() for line in output.splitlines() if line.startswith("  ")]
    assert runs == ["cnn-ddp-ws4-fp32", "own-compute-only-ws4-fp32", "own-fsdp2-ws4-fp32"]
    code, output = _bench(capsys, tmp_path, sweep, "--strategies", "ddp", "--repeat", "2")
    assert code == 0, output
    runs = [line.strip() for line in output.splitlines() if line.startswith("  ")]
    assert runs == [
        "cnn-ddp-ws1-fp32-r1",
        "cnn-ddp-ws2-fp32-r1",
        "own-ddp-ws2-fp32-r1",
        "cnn-ddp-ws1-fp32-r2",
        "cnn-ddp-ws2-fp32-r2",
        "own-ddp-ws2-fp32-r2",
    ]


def test_srun_launch_inside_an_allocation(monkeypatch, tmp_path):
    run = RunSpec("gpt-fsdp2-ws4-fp32", "fsdp2", 4, "gpt", "fp32", "true", 1, {})
    cmd = runner.command(run, tmp_path, "srun", "--gpus-per-task=1")
    assert cmd[:4] == ["srun", "--ntasks=4", "--kill-on-bad-exit=1", "--gpus-per-task=1"]
    assert cmd[5:9] == ["-m", "fsdp2lab", "train", "--config"] and "--nproc-per-node" not in cmd
    local = runner.command(run, tmp_path, "local")
    assert local[-2:] == ["--nproc-per-node", "4"]
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert runner.pick_launcher("auto") == "local"
    with pytest.raises(Exception, match="needs a Slurm allocation"):
        runner.pick_launcher("srun")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(runner.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert runner.pick_launcher("auto") == "srun"
