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
        # The gradient is taken in forward and scaled by the upstream 1/3 in backward: rounded
        # to the logits' dtype twice: within one bf16 ulp, 2**-7 of it.
        rtol = 2**-7 if dtype == torch.bfloat16 and chunk < 10_000 else 1.3e-6
        torch.testing.assert_close(grad, want_grad, rtol=rtol, atol=0)


@pytest.mark.parametrize(
    "dtype, upstream",
    [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float16, 2.0**16)],
)
def test_the_gradient_is_torchs_exactly_where_rounded_once(dtype, upstream):
    """An upstream gradient of 1 (one micro-batch, no scaler) leaves a taken-in-forward gradient
    as it is; fp16's, taken in backward, has a loss scaler's factor applied before its rounding."""
    logits, target = logits_and_targets(dtype)
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    (want_grad,) = torch.autograd.grad(want * upstream, logits)
    (grad,) = torch.autograd.grad(loss.cross_entropy(logits, target, chunk_tokens=8) * upstream,
                                  logits)  # fmt: skip
    torch.testing.assert_close(grad, want_grad, rtol=1.3e-6, atol=0)
    assert grad.count_nonzero() == want_grad.count_nonzero()  # nothing flushed to zero


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "dtype, recomputed", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)]
)
def test_backward_recomputes_no_log_softmax_but_fp16s(dtype, recomputed):
    """The gradient is taken in forward, with the loss: backward only scales it (fp16's is the
    exception, and the control)."""
    logits, target = logits_and_targets(dtype)
    out = loss.cross_entropy(logits, target, chunk_tokens=8)
    with OpNames() as seen:
        out.backward()
    assert ("aten._log_softmax.default" in seen.names) is recomputed, sorted(seen.names)


def test_a_second_backward_through_the_loss_says_why_it_cannot():
    logits, target = logits_and_targets(torch.bfloat16)
    out = loss.cross_entropy(logits, target, chunk_tokens=8)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="its backward runs once"):
        out.backward()


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


def _vocab_parallel_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits, target = logits_and_targets(torch.float32, vocab=60)
        logits.data[1, 3, 41] = 50.0  # an argmax in the second rank's columns
        mesh = init_device_mesh("cpu", (2,))
        for reduction in ("mean", "sum"):
            want = F.cross_entropy(logits.reshape(-1, 60), target.reshape(-1), reduction=reduction)
            (want_grad,) = torch.autograd.grad(want / 3, logits)
            sharded = distribute_tensor(logits.detach(), mesh, [Shard(2)]).requires_grad_()
            got = loss.cross_entropy(sharded, target, reduction, chunk_tokens=8)
            (got_grad,) = torch.autograd.grad(got / 3, sharded)
            assert got_grad.placements == (Shard(2),)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got_grad.full_tensor(), want_grad, rtol=1e-6, atol=1e-7)
        hits = loss.correct(distribute_tensor(logits.detach(), mesh, [Shard(2)]), target)
        assert hits == loss.correct(logits.detach(), target) > 0
        results.put((rank, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocabulary_parallel_cross_entropy_and_correct_are_the_whole_logits():
    """Logits sharded on the vocabulary over 2 gloo ranks (``loss_parallel``, chunked): loss,
    gradient (sharded as the logits) and the argmax count equal those of the whole logits."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_vocab_parallel_worker, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == {0: None, 1: None}, got


class _Cost(TorchDispatchMode):
    """Ops that would launch GPU work (no views or allocations), and the bytes they read and
    write (every tensor argument and result, once)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and "empty" not in func._schema.name:
            self.ops.append(func._schema.name)
            # An out= tensor is the op's result: written once, not read.
            read = (args, {k: v for k, v in (kwargs or {}).items() if k != "out"})
            tensors = [t for t in tree_leaves((read, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_a_steps_chunked_loss_launches_8_plus_6_ops_a_chunk_and_2_bytes_a_logit_over_torchs(
    chunks, dtype
):
    """The trainer's loss (``root``: backward starts at it): forward and backward at most
    8 + 6 x chunks ops, and at most 2 bytes per logit (plus a few per token) more than
    ``F.cross_entropy`` on the upcast logits; backward hands the gradient on, no pass of its own.
    fp32 logits get their gradient from log-softmax's backward directly (no copy: 8 B/logit)."""
    tokens, vocab = 64, 1000
    logits = torch.randn(tokens, vocab).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    with _Cost() as ours:
        loss.cross_entropy(logits, target, chunk_tokens=tokens // chunks, root=True).backward()
    logits.grad = None
    with _Cost() as plain:
        F.cross_entropy(logits.float(), target).backward()
    assert len(ours.ops) <= 8 + 6 * chunks, ours.ops
    assert ours.bytes - plain.bytes <= 2 * tokens * vocab + 64 * tokens, ours.bytes - plain.bytes
    assert "aten::mul_" not in ours.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_micro_batchs_share_is_folded_in_and_rounded_once(dtype):
    """``weight`` (1/K over K micro-batches) and ``root``: the loss and the gradient of
    ``F.cross_entropy(...) * weight``, the gradient rounded to the logits' dtype once; without
    ``root`` backward still scales by its incoming gradient (the control: x 3)."""
    logits, target = logits_and_targets(dtype)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    want = F.cross_entropy(flat, target.reshape(-1)) / 4
    (want_grad,) = torch.autograd.grad(want, logits)
    got = loss.cross_entropy(logits, target, chunk_tokens=8, weight=0.25, root=True)
    (grad,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1.3e-6, atol=0)
    scaled = loss.cross_entropy(logits, target, chunk_tokens=8, weight=0.25)
    (grad3,) = torch.autograd.grad(scaled * 3, logits)
    torch.testing.assert_close(grad3, want_grad * 3, rtol=2**-7, atol=0)
