"""Real data: the seed's CNN on Fashion-MNIST (Debian's dataset-fashion-mnist files)."""

from __future__ import annotations

import pytest

from conftest import FASHION_DIR, train


@pytest.mark.slow
@pytest.mark.skipif(
    not FASHION_DIR.is_dir(), reason=f"{FASHION_DIR} missing: apt-get install dataset-fashion-mnist"
)
def test_cnn_on_fashion_mnist_two_ranks_one_epoch(tmp_path):
    """The main job's recipe (--recipe tuned) reaches 90% test accuracy in one epoch (issue 14)."""
    run = train(tmp_path, "--model", "cnn", "--dataset", "fashion-mnist", "--epochs", "1", "--nproc-per-node", "2",
                "--progress", "off", timeout=900)  # fmt: skip
    (epoch,) = run.events("epoch")
    assert epoch["test_accuracy"] >= 0.90, epoch
    assert "Accuracy: " in run.stdout and "/10000 (" in run.stdout
    assert run.summary["dataset"] == "fashion-mnist" and run.summary["world_size"] == 2
