"""Evaluation on CPU runs the forward over pieces of each test batch: the same metrics."""

from __future__ import annotations

import pytest

from fsdp2lab.config import TrainConfig
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
