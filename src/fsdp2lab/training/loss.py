"""The loss of a training step and of evaluation: the user's (``--loss``, a model's own) or
cross-entropy, computed over a bounded number of tokens' fp32 logits at a time.

A language model's logits are tokens x vocabulary: upcast to fp32 whole, with the log-softmax
autograd keeps, they are the largest tensors of a step (4 x 2048 tokens x 128,256 = 4.2 GB each).
:func:`cross_entropy` upcasts ``chunk_tokens`` tokens' logits at a time, keeps none of them for
the backward, and recomputes each chunk there, writing its gradient into one gradient tensor of
the logits' own dtype. Loss and gradients are ``F.cross_entropy``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fsdp2lab.models.spec import logits_of

# The fp32 logits one chunk may hold: 130 tokens of a 128,256-token vocabulary (16.7 M values,
# plenty for a GPU kernel); a byte-level model's whole batch up to 65,536 tokens.
CHUNK_BYTES = 64 * 2**20
IGNORE_INDEX = -100  # F.cross_entropy's: targets that count in neither the loss nor its mean


def chunk_tokens_for(vocab: int) -> int:
    """Tokens per chunk for logits over ``vocab`` classes: ``CHUNK_BYTES`` of fp32 logits."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V), any float dtype, against ``target`` (...), in fp32.

    ``reduction``: "mean" (over the targets that are not ``IGNORE_INDEX``) or "sum". At most
    ``chunk_tokens`` (default :func:`chunk_tokens_for` V) tokens' logits are upcast at a time;
    with no more tokens than that it is ``F.cross_entropy`` on the fp32 logits, as it always was.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    flat, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    chunk = chunk_tokens or chunk_tokens_for(flat.shape[-1])
    if flat.shape[0] <= chunk:
        return F.cross_entropy(flat.float(), flat_target, reduction=reduction)
    return _ChunkedCrossEntropy.apply(flat, flat_target, reduction == "mean", chunk)


def correct(logits: torch.Tensor, target: torch.Tensor) -> float:
    """How many argmax predictions of ``logits`` (..., V) equal ``target`` (...)."""
    flat, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    chunk = chunk_tokens_for(flat.shape[-1])
    hits = torch.zeros((), dtype=torch.int64, device=flat.device)
    for piece, t in zip(flat.split(chunk), flat_target.split(chunk), strict=True):
        hits += (piece.argmax(dim=-1) == t).sum()
    return float(hits)  # one device sync


def model_loss(
    output: Any,
    target: torch.Tensor,
    user_loss: Callable[[Any, Any], torch.Tensor] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """The loss of a model's ``output``: ``user_loss(output, target)`` (a mean over the batch;
    "sum" is that mean x ``target.numel()``) where given (``RunPlan.loss``), else
    :func:`cross_entropy` of its logits."""
    if user_loss is not None:
        mean = user_loss(output, target)
        return mean if reduction == "mean" else mean * target.numel()
    return cross_entropy(logits_of(output), target, reduction)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` over (N, V) logits, ``chunk`` rows at a time, forward and backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, mean: bool, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for piece, t in zip(logits.split(chunk), target.split(chunk), strict=True):
            total += F.cross_entropy(piece.float(), t, reduction="sum")
        ctx.save_for_backward(logits, target)
        ctx.chunk = chunk
        ctx.count = (target != IGNORE_INDEX).sum() if mean else None
        return total / ctx.count if mean else total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, target = ctx.saved_tensors
        # As F.cross_entropy's mean: its backward scales by grad_output / count.
        scale = grad_output if ctx.count is None else grad_output / ctx.count
        grad = torch.empty_like(logits)
        pieces = zip(
            logits.split(ctx.chunk), target.split(ctx.chunk), grad.split(ctx.chunk), strict=True
        )
        for piece, t, out in pieces:
            with torch.enable_grad():
                piece = piece.detach().requires_grad_()
                loss = F.cross_entropy(piece.float(), t, reduction="sum")
                (piece_grad,) = torch.autograd.grad(loss, piece, scale)
            out.copy_(piece_grad)
        return grad, None, None, None
