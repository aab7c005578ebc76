"""Evaluation on CPU runs the forward over pieces of each test batch: the same metrics."""

from __future__ import annotations

import pytest

from conftest import train
from fsdp2lab.config import TrainConfig
from fsdp2lab.plan import resolve
from fsdp2lab.training import evaluation
from fsdp2lab.training.trainer import Trainer


@pytest.mark.parametrize(
    "model",
    [
        {"model": "cnn"},
        {"model": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16},
    ],
)
def test_evaluation_in_pieces_gives_the_whole_batches_metrics(one_rank, monkeypatch, model):
    cfg = TrainConfig(
        **model, dataset="synthetic", synthetic_size=1024, test_batch_size=100, progress="off"
    )
    trainer = Trainer(cfg, one_rank)
    sizes = []
    trainer.model.register_forward_pre_hook(lambda _, args: sizes.append(len(args[0])))
    monkeypatch.setattr(evaluation, "CPU_PIECE", 1000)  # whole batches
    whole = evaluation.evaluate(trainer)
    assert sizes == [100, 100, 56]  # the test set: 256 samples
    sizes.clear()
    monkeypatch.setattr(evaluation, "CPU_PIECE", 7)  # pieces, the last of each batch shorter
    pieces = evaluation.evaluate(trainer)
    assert sizes == 2 * ([7] * 14 + [2]) + [7] * 8
    assert whole["count"] == pieces["count"]
    assert whole["correct"] == pieces["correct"]
    # The same sums of the same logits, up to the kernels' rounding at another batch size.
    assert pieces["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6, abs=0)


@pytest.mark.parametrize(
    "flags, world, want",
    [
        ({"model": "gpt", "batch_size": 8}, 1, 8),  # the training micro-batch
        ({"model": "gpt", "batch_size": 8, "pp": 2}, 2, 2),  # one of its 4 pipeline micro-batches
        ({"model": "gpt", "test_batch_size": 100}, 1, 100),  # yours
        ({"model": "cnn"}, 2, 1000),  # a classifier: the seed's
    ],
)
def test_test_batch_size_default_is_resolved_in_the_plan(flags, world, want):
    plan = resolve(TrainConfig(**flags, dataset="synthetic"), world, "cpu")
    assert plan.cfg.test_batch_size == want
    assert f"test_batch_size = {want}\n" in plan.cfg.to_toml()  # the resolved config printed


def test_evaluation_memory_is_bounded_by_a_training_steps(tmp_path):
    """A Llama-3-sized vocabulary (128,256): the run's peak, a periodic and the epoch-end
    evaluation included, stays within 25% of its training steps' peak before any evaluation
    (measured: 4% above it on a quiet machine, 10% with other tests running beside it: the peak
    RSS moves with when the allocator's threads run; steps 3 and 4 alone reach that). The 8 test
    samples evaluated in one batch, as the old default of 1000 did, hold 4x a step's logits
    (525 MB in fp32) and their log-softmax: 1.54x the steps' peak."""
    run = train(
        tmp_path,
        *["--model", "gpt", "--vocab-size", "128256", "--d-model", "64", "--n-layers", "1"],
        *["--n-heads", "2", "--seq-len", "128", "--batch-size", "2", "--dataset", "synthetic"],
        *["--synthetic-size", "32", "--max-steps", "4", "--nproc-per-node", "1"],
        *["--log-every-steps", "1", "--eval-every-steps", "2", "--progress", "off"],
    )
    assert [r["step"] for r in run.events("eval")] == [2, 4]
    before_eval = [r["peak_memory_bytes"][0] for r in run.events("step") if r["step"] <= 2]
    assert len(before_eval) == 2
    peak = run.summary["peak_memory_bytes"][0]
    assert peak <= 1.25 * max(before_eval), (peak, before_eval)
