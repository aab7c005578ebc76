"""``--grad-accum-reduce``: reduce-scatter every micro-batch (HSDP all-reduces on the last only)
trains as no communication until the last micro-batch does, and as one larger batch; the plan
shows what it saves (sharded gradients instead of unsharded ones between micro-batches)."""

from __future__ import annotations

import pytest

from conftest import GPT_TINY, TINY, assert_close_lists, read_metrics, run_variants
from fsdp2lab.config import TrainConfig
from fsdp2lab.parallel.fsdp2 import reduces_every_micro_batch
from fsdp2lab.plan import resolve
from fsdp2lab.scale.simulate import simulate

STEPS = ["--max-steps", "16", "--log-every-steps", "1", "--optimizer", "adam", "--device", "cpu"]


def test_auto_reduces_every_micro_batch_where_sharded():
    assert reduces_every_micro_batch("auto", 2) and not reduces_every_micro_batch("auto", 1)
    assert reduces_every_micro_batch("every", 1) and not reduces_every_micro_batch("last", 8)


@pytest.mark.parametrize(
    "ranks, mesh",
    [
        pytest.param(2, [], id="fsdp2-2"),
        pytest.param(4, ["--dp-replicate", "2"], id="hsdp-2x2", marks=pytest.mark.slow),
    ],
)
def test_every_equals_last_and_a_larger_batch(tmp_path, ranks, mesh):
    """The three runs one after another in the same ranks (tests/scripts/resume_matrix.py)."""
    accum = ["--batch-size", "2", "--grad-accum-steps", "4"]
    variants = {
        "every": {"flags": [*accum, "--grad-accum-reduce", "every"]},
        "last": {"flags": [*accum, "--grad-accum-reduce", "last"]},
        "large": {"flags": ["--batch-size", "8"]},
    }
    run_variants(tmp_path, ranks, variants, [*GPT_TINY, *TINY, *STEPS, *mesh])
    runs = {name: read_metrics(tmp_path / f"{name}.jsonl") for name in variants}
    for metrics in runs.values():
        (summary,) = [r for r in metrics if r["event"] == "summary"]
        assert summary["world_size"] == ranks
    every, last, large = ([r["loss"] for r in m if r["event"] == "step"] for m in runs.values())
    assert len(every) == 16
    assert_close_lists(every, last, 1e-5)
    assert_close_lists(every, large, 1e-5)


def test_plan_shows_what_reducing_every_micro_batch_saves():
    """Between micro-batches each rank holds sharded gradients, not unsharded ones."""
    base = TrainConfig(model="gpt", d_model=256, n_layers=4, seq_len=64, vocab_size=512,
                       batch_size=2, grad_accum_steps=4, optimizer="adamw")  # fmt: skip
    runs = {}
    for mode in ("every", "last"):
        cfg = TrainConfig(**{**base.__dict__, "grad_accum_reduce": mode})
        runs[mode] = simulate(resolve(cfg, 8))
    every, last = runs["every"], runs["last"]
    assert every.state == last.state
    assert every.peak_by_category["unsharded_grads"] == 0
    assert last.peak_by_category["unsharded_grads"] > 0
    assert every.peak_bytes < last.peak_bytes
    # 4 reduce-scatters a unit per step against 1
    assert (
        every.comm["dp_shard"]["reduce_scatter"].calls
        == 4 * last.comm["dp_shard"]["reduce_scatter"].calls
    )


def test_plan_report_shows_both_modes():
    from fsdp2lab.scale.estimate import Hardware
    from fsdp2lab.scale.gpus import get_gpu
    from fsdp2lab.scale.report import format_report, plan_report

    cfg = TrainConfig(model="gpt", d_model=256, n_layers=4, seq_len=64, vocab_size=512,
                      batch_size=2, grad_accum_steps=4, optimizer="adamw")  # fmt: skip
    r = plan_report(cfg, 8, Hardware(get_gpu("h100"), 8, 50.0), alternatives=False)
    assert r["grad_accum_reduce"] == "every"
    other = r["grad_accum_other"]
    assert other["grad_accum_reduce"] == "last"
    assert other["peak_bytes_per_rank"] > r["peak_bytes_per_rank"]
    assert other["comm_bytes_per_step"]["dp_shard"] < r["comm_bytes_per_step"]["dp_shard"]
    assert "--grad-accum-reduce every (above); with last" in format_report(r)
