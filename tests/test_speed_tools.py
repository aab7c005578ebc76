"""Tools for speed work: ``--target-accuracy`` / ``--eval-every-steps`` and ``--profile``."""

from __future__ import annotations

import csv
import json
import re

import pytest

from conftest import read_metrics, run_cli, train
from fsdp2lab.bench.results import step_time
from fsdp2lab.config import TrainConfig
from fsdp2lab.plan import resolve
from fsdp2lab.training.trace import PARTS, breakdown

SYNTH = ["--dataset", "synthetic", "--synthetic-size", "2048", "--progress", "off"]


def _evals(run) -> list[tuple[int, float]]:
    return [(r["step"], r["test_accuracy"]) for r in run.events("eval")]


TUNED = {"optimizer": "adam", "lr": 2e-3, "dropout": 0.0, "global_batch_size": 128}
# The plan fills the optimizer's default learning rate where neither you nor a recipe set one.
SEED = {"optimizer": "adadelta", "lr": 1.0, "dropout": None, "global_batch_size": None}


@pytest.mark.parametrize(
    "given, want",
    [
        ({}, TUNED),  # the main job: cnn, dataset auto (MNIST, else Fashion-MNIST)
        ({"dataset": "fashion-mnist"}, TUNED),
        ({"recipe": "seed"}, SEED),
        ({"dataset": "synthetic"}, SEED),  # no recipe measured for it
        ({"model": "mlp", "dataset": "mnist"}, SEED),
        # The user's values win; the optimizer and its learning rate come from the recipe only
        # together (a seed command's --lr 1.0 must not reach Adam).
        ({"lr": 1.0}, {**TUNED, "optimizer": "adadelta", "lr": 1.0}),
        ({"optimizer": "sgd"}, {**TUNED, "optimizer": "sgd", "lr": 0.01}),
        (
            {"dropout": 0.5, "global_batch_size": 32},
            {**TUNED, "dropout": 0.5, "global_batch_size": 32},
        ),
        # The seeds' per-rank --batch-size decides the global batch (32 x 2 ranks).
        ({"batch_size": 32}, {**TUNED, "global_batch_size": None, "batch_size": 32}),
    ],
)
def test_recipe_fills_only_what_the_user_left_unset(given, want):
    plan = resolve(TrainConfig(**given), 2)
    assert {k: getattr(plan.cfg, k) for k in want} == want
    assert plan.global_batch == (want["global_batch_size"] or 64)
    assert resolve(plan.cfg, 2).cfg == plan.cfg  # resolving again changes nothing


@pytest.mark.slow  # the README's test command stays under 15 minutes
def test_target_accuracy_stops_at_the_first_evaluation_at_or_above_it(tmp_path):
    # 32 steps an epoch; evaluations at steps 4, 8, ..., 28 and at the end of the epoch (32).
    flags = [*SYNTH, "--epochs", "1", "--eval-every-steps", "4", "--nproc-per-node", "2"]
    # A target never reached trains to the end: this run is the reference.
    full = train(tmp_path, *flags, "--target-accuracy", "100", name="never")
    assert not full.events("target_reached")
    evals = _evals(full)
    assert [s for s, _ in evals] == [4, 8, 12, 16, 20, 24, 28, 32]
    # A target first reached in the middle, and exactly (>=, not >): the best of the first half
    # is reached again or beaten later only from the evaluation where it first occurs.
    best_early = max(a for s, a in evals if s <= 16)
    first = next(i for i, (_, a) in enumerate(evals) if a >= best_early)
    assert 0 < first < len(evals) - 1, f"no evaluation in the middle reaches a target: {evals}"
    stop_step = evals[first][0]

    run = train(tmp_path, *flags, "--target-accuracy", repr(best_early), name="target")
    assert _evals(run) == evals[: first + 1]  # the same run, up to the first at/above target
    (reached,) = run.events("target_reached")
    assert reached["step"] == stop_step and reached["test_accuracy"] == best_early
    assert 0 < reached["elapsed_s"] < run.summary["train_time_s"] + 1e-6
    assert run.summary["steps"] == stop_step
    assert "training stopped: test accuracy" in run.stderr + run.stdout


@pytest.mark.parametrize("bad", ["0", "-1", "101", "nan"])
def test_a_bad_target_accuracy_is_one_usage_error(tmp_path, bad):
    run = train(tmp_path, *SYNTH, "--target-accuracy", bad, check=False)
    assert run.returncode == 2
    assert "--target-accuracy must be in" in run.stderr and "Traceback" not in run.stderr


def test_profile_writes_a_trace_per_rank_and_a_breakdown_of_measured_parts(tmp_path):
    run = train(tmp_path, *SYNTH, "--max-steps", "12", "--profile", "prof", "--nproc-per-node", "2")
    for rank in (0, 1):
        trace = json.loads((tmp_path / "prof" / f"rank{rank}.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {f"ProfilerStep#{i}" for i in range(6, 11)} <= names  # 5 steps after warm-up
        assert "fsdp2lab.data" in names
    (record,) = run.events("profile")
    trace = tmp_path / "prof" / "rank0.pt.trace.json"
    steps = breakdown(trace)
    assert len(steps) == record["steps"] == 5
    # ``host`` is the step's remainder; the other parts are measured spans. They must not overlap
    # (their sum fits in the step), and data and optimizer equal their own ranges in the raw
    # trace, summed here without the breakdown's code.
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e["name"].startswith("ProfilerStep#"))  # fmt: skip

    def ranged(prefixes: tuple[str, ...], start: float, end: float) -> float:
        return sum(e["dur"] for e in events
                   if e["name"].startswith(prefixes) and start <= e["ts"] < end) / 1000  # fmt: skip

    for step, (start, end) in zip(steps, windows, strict=True):
        assert set(step) == {"step", *PARTS}
        measured = step["data"] + step["optimizer"] + step["exposed_comm"] + step["compute"]
        assert measured <= step["step"] * (1 + 1e-9), step
        assert step["data"] == pytest.approx(ranged(("fsdp2lab.data",), start, end), abs=1e-6)
        optimizer = ranged(("Optimizer.step#", "Optimizer.zero_grad#"), start, end)
        assert step["optimizer"] == pytest.approx(optimizer, abs=1e-6)
        assert step["compute"] > 0 and step["exposed_comm"] > 0 and step["optimizer"] > 0
    assert "exposed_comm" in run.stderr + run.stdout


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}


def test_breakdown_of_a_known_cpu_trace(tmp_path):
    """One 100 us step: data 0-10, forward ops 10-40 with a collective 20-30 inside (its copy op
    nested in it counts as communication), an op on another thread (not the step's), the
    optimizer 60-80 with ops in it; 40-60 and 80-100 are host time."""
    events = [
        _x("ProfilerStep#3", 0, 100),
        _x("fsdp2lab.data", 0, 10),
        _x("aten::to", 2, 5),
        _x("aten::linear", 10, 30),
        _x("FSDP::all_gather", 20, 10),
        _x("aten::copy_", 22, 4),
        _x("aten::mm", 45, 5, tid=2),
        _x("Optimizer.step#Adam.step", 60, 20),
        _x("aten::_fused_adam_", 61, 18),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (step,) = breakdown(path)
    ms = {k: round(v * 1000, 6) for k, v in step.items()}  # back to microseconds
    assert ms == {"step": 100, "data": 10, "optimizer": 20, "exposed_comm": 10, "compute": 20,
                  "host": 40}  # fmt: skip


def test_breakdown_of_a_known_gpu_trace(tmp_path):
    """GPU: compute kernels 10-50, an NCCL kernel 40-70 (10 us hidden under compute, 20 exposed)."""
    events = [
        _x("ProfilerStep#1", 0, 100),
        _x("aten::mm", 5, 10),
        _x("gemm_kernel", 10, 40, tid=7, cat="kernel"),
        _x("ncclDevKernel_ReduceScatter", 40, 30, tid=8, cat="kernel"),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (step,) = breakdown(path)
    ms = {k: round(v * 1000, 6) for k, v in step.items()}
    assert ms == {"step": 100, "data": 0, "optimizer": 0, "exposed_comm": 20, "compute": 40,
                  "host": 40}  # fmt: skip


def test_breakdown_of_a_cuda_trace_counts_the_host_threads_steps_only(tmp_path):
    """As torch writes a CUDA trace: each ``ProfilerStep#N`` on the training thread (pid and tid
    of the process) and again on the GPU stream's lane (pid 0, tid 7, ``gpu_user_annotation``,
    shifted to the kernels' time), the lanes written first. 5 steps of 1000 us, each: data 0-100,
    a GEMM kernel 300-500, an NCCL kernel on another stream 450-650 (150 us exposed), the
    optimizer 800-900."""
    host, gpu = [], []
    for i in range(5):
        b = 1_000_000 + 1000 * i
        host += [
            _x(f"ProfilerStep#{6 + i}", b, 1000, tid=4242, cat="user_annotation"),
            _x("fsdp2lab.data", b, 100, tid=4242, cat="user_annotation"),
            _x("aten::mm", b + 100, 50, tid=4242),
            _x("cudaLaunchKernel", b + 110, 10, tid=4242, cat="cuda_runtime"),
            _x("Optimizer.step#AdamW.step", b + 800, 100, tid=4242, cat="user_annotation"),
        ]
        gpu += [
            _x(f"ProfilerStep#{6 + i}", b + 290, 950, tid=7, cat="gpu_user_annotation"),
            _x("fsdp2lab.data", b + 290, 10, tid=7, cat="gpu_user_annotation"),
            _x("ampere_sgemm_64x32", b + 300, 200, tid=7, cat="kernel"),
            _x("ncclDevKernel_AllReduce_Sum_f32", b + 450, 200, tid=20, cat="kernel"),
        ]
    for e in host:
        e["pid"] = 4242
    for e in gpu:
        e["pid"] = 0
    meta = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [*meta, *gpu, *host]}))
    steps = breakdown(path)
    assert len(steps) == 5, steps
    for step in steps:
        ms = {k: round(v * 1000, 6) for k, v in step.items()}
        assert ms == {"step": 1000, "data": 100, "optimizer": 100, "exposed_comm": 150,
                      "compute": 200, "host": 450}  # fmt: skip


SPEED_SWEEP = """
[sweep]
strategies = ["fsdp2"]
world_sizes = [2]
models = ["mlp-fast", "mlp-slow"]

[train]
dataset = "synthetic"
synthetic_size = 1024
max_steps = 12
log_every_steps = 2
eval_every_steps = 4

[models.mlp-fast]      # a model of its own: mlp, with its own strategies
model = "mlp"
strategies = ["compute-only", "fsdp2"]
target_accuracy = 0.05

[models.mlp-slow]
model = "mlp"
strategies = ["ddp"]
"""


@pytest.mark.slow  # a sweep of profiled runs: a minute
def test_bench_side_by_side_aliases_time_to_target_and_profile(tmp_path):
    (tmp_path / "sweep.toml").write_text(SPEED_SWEEP)
    proc = run_cli(
        ["bench", "--sweep", "sweep.toml", "--out", "res", "--profile"], cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = tmp_path / "res"
    runs = sorted(p.name for p in res.iterdir() if (p / "status.json").exists())
    assert runs == [
        "mlp-fast-compute-only-ws2-fp32",
        "mlp-fast-fsdp2-ws2-fp32",
        "mlp-slow-ddp-ws2-fp32",
    ]
    side = res / "mlp-fast-compute-only-ws2-fp32"
    # Two one-rank runs at once, 32 samples each (the recipe's 64 over 2 ranks).
    assert len((side / "command.txt").read_text().splitlines()) == 2
    copies = [read_metrics(side / m) for m in ("metrics.jsonl", "metrics-1.jsonl")]
    for records in copies:
        (summary,) = [r for r in records if r["event"] == "summary"]
        assert summary["world_size"] == 1 and summary["global_batch_size"] == 32
    rows = {r["run"]: r for r in csv.DictReader((res / "results.csv").open())}
    row = rows[side.name]
    assert row["copies"] == "2" and row["global_batch_size"] == "64" and row["model"] == "mlp-fast"
    assert float(row["samples_per_s"]) == pytest.approx(
        sum(32 / step_time(c) for c in copies), rel=1e-9
    )
    # The target (5%) is reached at the first evaluation (step 4).
    fast = rows["mlp-fast-fsdp2-ws2-fp32"]
    assert fast["steps_to_target"] == "4" and float(fast["time_to_target_s"]) > 0
    assert rows["mlp-slow-ddp-ws2-fp32"]["steps_to_target"] == ""
    summary = (res / "summary.md").read_text()
    assert "of compute-only" in summary and "Time to the target accuracy" in summary
    assert "Where a step goes" in summary
    slow = res / "mlp-slow-ddp-ws2-fp32"
    assert (slow / "profile" / "rank1.pt.trace.json").is_file()
    assert float(rows[slow.name]["profile_step_ms"]) > 0
    # The run that reached its target at step 4 ended before the profiled steps, and says so.
    assert "ended before the profiled steps" in (res / fast["run"] / "stdout.log").read_text()
    assert (res / "plots" / "mlp-slow-accuracy-vs-time.png").is_file()


def test_sweep_plans_model_aliases_own_axes_repeats_and_side_by_side(tmp_path):
    from fsdp2lab.bench import sweep

    path = tmp_path / "s.toml"
    path.write_text(
        SPEED_SWEEP.replace('strategies = ["ddp"]', 'strategies = ["ddp"]\nrepeat = 1').replace(
            "[sweep]", "[sweep]\nrepeat = 2"
        )
    )
    runs, skipped = sweep.plan(sweep.load_sweep(str(path)))
    assert not skipped
    assert [(r.run_id, r.copies, r.values["model"]) for r in runs] == [
        ("mlp-fast-compute-only-ws2-fp32-r1", 2, "mlp"),
        ("mlp-fast-fsdp2-ws2-fp32-r1", 1, "mlp"),
        ("mlp-slow-ddp-ws2-fp32-r1", 1, "mlp"),
        ("mlp-fast-compute-only-ws2-fp32-r2", 2, "mlp"),
        ("mlp-fast-fsdp2-ws2-fp32-r2", 1, "mlp"),
    ]
    side = runs[0].values
    assert side["strategy"] == "single" and side["global_batch_size"] == 32
    assert "side_by_side" not in side and runs[1].values["target_accuracy"] == 0.05


@pytest.mark.parametrize(
    "table, message",
    [
        ('[models.x]\nmodel = "nope"', "[models.x] is no model"),
        ('[models.x]\nmodel = "mlp"\nrepeat = 0', "repeat must be an integer >= 1"),
        ('[models.x]\nmodel = "mlp"\nstrategies = ["warp"]', "strategies: unknown 'warp'"),
        ('[variants.v]\nside_by_side = "yes"', "side_by_side must be true or false"),
    ],
)
def test_sweep_model_and_variant_tables_are_checked(tmp_path, table, message):
    from fsdp2lab.bench import sweep
    from fsdp2lab.errors import UsageError

    path = tmp_path / "s.toml"
    path.write_text(f'[sweep]\nmodels = ["x"]\n{table}\n' if "models.x" in table else table)
    with pytest.raises(UsageError, match=re.escape(message)):
        sweep.plan(sweep.load_sweep(str(path)))


def test_throughput_is_shared_against_compute_only_with_the_same_host_malloc():
    from fsdp2lab.bench.report import _extra_tables

    def line(samples_per_s, copies, host_malloc):
        v = {"n": 1, "global_batch_size": 64, "copies": copies, "host_malloc": host_malloc}
        v.update({f"samples_per_s{s}": samples_per_s for s in ("", ":min", ":max")})
        return v

    agg = {
        ("cnn", "fp32", "compute-only", 2): line(2000.0, 2, "cached"),
        ("cnn", "fp32", "compute-only-system-malloc", 2): line(1000.0, 2, "system"),
        ("cnn", "fp32", "fsdp2", 2): line(1800.0, 1, "cached"),
        ("cnn", "fp32", "fsdp2-system-malloc", 2): line(800.0, 1, "system"),
    }
    table = "\n".join(_extra_tables(agg))
    assert "| cnn | fsdp2 | 2 | 64 | 1800 | 90% |" in table
    assert "| cnn | fsdp2-system-malloc | 2 | 64 | 800 | 80% |" in table
