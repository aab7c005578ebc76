"""The loss (training/loss.py): cross-entropy over chunks of tokens is F.cross_entropy's, loss and
gradients, and never holds more than a chunk of tokens' logits in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp2lab.training import loss


def logits_and_targets(dtype: torch.dtype, shape=(3, 37), vocab: int = 50):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, vocab, generator=generator).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, shape, generator=generator)
    target[0, :5] = loss.IGNORE_INDEX  # counted in neither the sum nor the mean
    return logits, target


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_is_torchs(dtype, reduction):
    logits, target = logits_and_targets(dtype)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    want = F.cross_entropy(flat, target.reshape(-1), reduction=reduction)
    (want_grad,) = torch.autograd.grad(want / 3, logits)  # an upstream scale, as 1/accum steps
    for chunk in (8, 111, 10_000):  # chunks, the last one shorter; one chunk; one (F's own path)
        got = loss.cross_entropy(logits, target, reduction, chunk_tokens=chunk)
        (grad,) = torch.autograd.grad(got / 3, logits)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # sums in another order
        torch.testing.assert_close(grad, want_grad, rtol=1.3e-6, atol=0)  # measured: equal


class Fp32Outputs(TorchDispatchMode):
    """The largest fp32 tensor any op makes, in elements."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_only_a_chunk_of_tokens_logits_is_upcast_forward_and_backward():
    vocab, chunk = 1000, 16
    logits, target = logits_and_targets(torch.bfloat16, shape=(4, 64), vocab=vocab)
    with Fp32Outputs() as seen:
        out = loss.cross_entropy(logits, target, chunk_tokens=chunk)
        out.backward()
    assert seen.largest == chunk * vocab  # F.cross_entropy on the whole: 256 tokens' logits
    assert logits.grad.dtype == torch.bfloat16
    # The default chunk: CHUNK_BYTES of fp32 logits, for a Llama-3 vocabulary too.
    assert 0 < loss.chunk_tokens_for(128_256) * 128_256 * 4 <= loss.CHUNK_BYTES
    assert loss.chunk_tokens_for(10**9) == 1


def test_correct_counts_argmax_hits_by_chunks(monkeypatch):
    logits, target = logits_and_targets(torch.float32, shape=(5, 41))
    want = float((logits.argmax(dim=-1) == target).sum())
    monkeypatch.setattr(loss, "CHUNK_BYTES", 7 * 50 * 4)  # 7 tokens a chunk
    assert loss.correct(logits, target) == want > 0


def test_model_loss_takes_yours_or_cross_entropy_of_the_logits():
    logits, target = logits_and_targets(torch.float32)
    hf_style = {"logits": logits}
    assert torch.equal(loss.model_loss(hf_style, target), loss.cross_entropy(logits, target))

    def yours(output, target):
        return torch.tensor(2.0)

    assert float(loss.model_loss(logits, target, yours)) == 2.0
    assert float(loss.model_loss(logits, target, yours, "sum")) == 2.0 * target.numel()
    with pytest.raises(ValueError, match="reduction"):
        loss.cross_entropy(logits, target, "none")
