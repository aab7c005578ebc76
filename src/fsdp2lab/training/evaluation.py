"""Evaluation on the test set: every rank its share, sums reduced over ranks; the seed's
"Test set" line, an ``eval`` record in the metrics file, and the ``after_eval`` hooks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fsdp2lab.data.sampler import eval_shards
from fsdp2lab.models.spec import logits_of
from fsdp2lab.parallel.fsdp2 import reshard_all
from fsdp2lab.runtime import logs
from fsdp2lab.training import loss

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer

log = logs.get_logger(__name__)

# On CPU the forward runs over pieces of this many samples of each test batch: the seed's 1000 a
# rank put the cnn's activations (230 MB) out of the caches. A GPU takes the whole batch (a
# language model's is its training micro-batch by default: see --test-batch-size).
CPU_PIECE = 64


def run(t: Trainer, epoch_end: bool) -> dict:
    """Evaluate at the current step; ``epoch_end`` prints the seed's line, else "at step N"."""
    st = t.state
    ev = {**evaluate(t), "step": st.step, "epoch": st.epoch, "elapsed_s": t.elapsed_s()}
    t.last_eval = ev
    at = "" if epoch_end else f" at step {st.step}"
    log.info(
        f"Test set{at}: Average loss: {ev['test_loss']:.4f}, Accuracy: {ev['correct']}/"
        f"{ev['count']} ({100.0 * ev['test_accuracy']:.2f}%)",
    )
    record = t.metrics.write("eval", **ev)
    for hook in t.hooks:
        hook.after_eval(t, record)
    return ev


@torch.no_grad()
def evaluate(t: Trainer) -> dict:
    """Test loss and accuracy over the whole test set; loss, correct and count summed over ranks.

    Each forward's logits are reduced to its loss and hits before the next forward (the loss in
    chunks of tokens, ``loss.py``): evaluation holds no more logits than a training step."""
    t.model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for indices, valid in eval_shards(
        len(t.test_set), t.cfg.test_batch_size, t.plan.dims.dp, t.dp_rank
    ):
        x, y = t._to_device(t.test_set.__getitems__(indices))
        for start, out in _outputs(t, x):
            n = min(max(valid - start, 0), len(out))  # the padding's outputs are dropped
            if n:
                target = y[start : start + n]
                loss_sum += float(t._loss(out[:n], target, reduction="sum"))
                correct += loss.correct(out[:n], target)
                count += target.numel()
            del out  # before the next forward
    sums = [loss_sum, correct, count]
    if t.pipeline is not None:
        sums = t.pipeline.from_last_stage(sums)
    loss_sum, correct, count = (v / t.replicas_per_dp_rank for v in t._all_reduce_sum(sums))
    reshard_all(t.model)
    t.model.train()
    return {
        "test_loss": loss_sum / max(count, 1),
        "test_accuracy": correct / max(count, 1),
        "correct": int(round(correct)),
        "count": int(round(count)),
    }


def _outputs(t: Trainer, x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first sample's index in ``x``, logits) per forward of a test batch: one forward, or on
    CPU pieces of ``CPU_PIECE`` samples; none on a pipeline stage before the last."""
    if t.pipeline is not None:
        with t._autocast():
            out = t.pipeline.forward(x)
        if out is not None:
            yield 0, logits_of(out)
        return
    start = 0
    for piece in x.split(CPU_PIECE) if x.device.type == "cpu" else (x,):
        yield start, _forward(t, piece)  # held by the caller only
        start += len(piece)


def _forward(t: Trainer, x: torch.Tensor) -> torch.Tensor:
    with t._autocast():
        return logits_of(t.model(x))
