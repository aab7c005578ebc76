"""Watching a run: TensorBoard scalars equal the metrics file, resume continues the curves, memory
in the summary, the tqdm bar, ``--memory-snapshot`` on CPU, and ``report`` overlaying runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS,
    TENSORS,
    EventAccumulator,
)

from conftest import GPT_TINY, TINY, run_cli, train
from fsdp2lab.training.tensorboard import scalars

RUN = [*TINY, *GPT_TINY, "--synthetic-size", "256", "--global-batch-size", "16",
       "--log-every-steps", "1", "--ckpt-dir", "ckpt", "--tensorboard"]  # fmt: skip
MEMORY = ["peak_memory_bytes", "rss_growth_bytes", "param_bytes", "grad_bytes",
          "optimizer_state_bytes"]  # fmt: skip


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """10 steps (with the bar on), then resumed to 20; TensorBoard's default folder."""
    tmp = tmp_path_factory.mktemp("observe")
    first = train(tmp, *RUN, "--max-steps", "10", "--progress", "on", name="first")
    second = train(tmp, *RUN, "--max-steps", "20", name="second")
    return tmp, first, second


def test_tensorboard_scalars_equal_the_metrics_file_and_resume_continues(resumed):
    tmp, first, second = resumed
    log_dir = tmp / "runs" / "ckpt"  # --ckpt-dir ckpt: next to it, the same on resume
    assert f"TensorBoard logs in {Path('runs') / 'ckpt'}" in second.stdout
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, TENSORS: 0})
    events.Reload()
    records = first.metrics + second.metrics
    want: dict[str, dict[int, float]] = {}
    for r in records:
        prefix = {"step": "train", "epoch": "epoch", "eval": "eval"}.get(r["event"])
        if prefix:
            for tag, value in scalars(r, prefix).items():
                assert r["step"] not in want.setdefault(tag, {}), (tag, r["step"])
                want[tag][r["step"]] = value
    assert set(events.Tags()[SCALARS]) == set(want)
    for tag in ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s",
                "epoch/test_loss", "epoch/test_accuracy", "eval/test_accuracy",
                "eval/elapsed_s", "memory/param_bytes/rank1",
                "memory/rss_growth_bytes/rank0"):  # fmt: skip
        assert tag in want, tag
    for tag, by_step in want.items():
        got = events.Scalars(tag)
        steps = [e.step for e in got]
        assert steps == sorted(by_step), (tag, steps)  # in order, no step twice
        for e in got:  # TensorBoard stores float32
            assert np.float32(e.value) == np.float32(by_step[e.step]), (tag, e.step)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 21))
    config = [e.step for e in events.Tensors("config/text_summary")]
    assert config == [0, 10]  # the resolved config of each run, at its first step


def test_summary_has_per_rank_memory(resumed):
    _, _, second = resumed
    summary = second.summary
    for key in [*MEMORY, "sharded_state_bytes"]:
        assert len(summary[key]) == 2, key
    # Against what the model is, not the meter's own formula: the two ranks' fp32 shards add up
    # to the model's parameter count (counted on the meta model); gradients are kept after the
    # step, one per parameter; Adadelta keeps two fp32 tensors a parameter, plus one step counter
    # (a scalar) per parameter tensor.
    params, grads = summary["param_bytes"], summary["grad_bytes"]
    assert sum(params) == 4 * summary["params_total"], (params, summary["params_total"])
    assert min(params) > 0.4 * max(params), params  # sharded evenly enough, not one rank's
    assert grads == params
    counters = [o - 2 * p for o, p in zip(summary["optimizer_state_bytes"], params, strict=True)]
    assert all(0 < c <= 8 * 64 for c in counters), counters
    step = second.events("step")[-1]
    assert all(len(step[key]) == 2 for key in MEMORY)


def test_progress_bar_is_tqdm_on_rank0_only(resumed):
    _, first, second = resumed
    bar = first.stderr
    assert bar.count("Epoch 1: 100%") >= 1 and "10/16" not in bar  # ends with --max-steps
    assert "10/10 [" in bar and "step/s" in bar and "loss=" in bar and "tokens/s=" in bar
    assert "Epoch 1:" not in second.stderr  # --progress off (TINY)


def test_report_overlays_runs_from_metrics_files_and_tensorboard(resumed):
    tmp, _, _ = resumed
    proc = run_cli(
        ["report", "first.jsonl", "second.jsonl", "runs/ckpt", "--out", "plots/curves.png"],
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr
    png = tmp / "plots" / "curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    missing = run_cli(["report", "first.jsonl", "nope.jsonl"], cwd=tmp)
    assert missing.returncode == 2 and "run not found: nope.jsonl" in missing.stderr


def test_memory_snapshot_on_cpu_is_one_usage_error(tmp_path):
    proc = run_cli(["train", *TINY, "--device", "cpu", "--memory-snapshot", "m.pickle"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--memory-snapshot needs a CUDA device") == 1
    assert "Traceback" not in proc.stderr
