"""The loss of a training step and of evaluation: the user's (``--loss``, a model's own) or
cross-entropy, computed over a bounded number of tokens' fp32 logits at a time.

A language model's logits are tokens x vocabulary: upcast to fp32 whole, with the log-softmax
autograd keeps, they are the largest tensors of a step (4 x 2048 tokens x 128,256 = 4.2 GB each).
:func:`cross_entropy` upcasts ``chunk_tokens`` tokens' logits at a time and keeps none of them:
each chunk's gradient is taken with its loss, in forward, and written straight into one gradient
tensor of the logits' own dtype (one rounding). A micro-batch's share of the step (``weight``,
1/K over K micro-batches) is folded into that gradient, and where backward starts at the loss
(``root``: the trainer's ``loss.backward()``, whose seed is 1) backward hands the gradient on
untouched: no pass over the logits of its own. Loss and gradients are ``F.cross_entropy``'s.

Under tensor parallelism the head's logits are a DTensor sharded on the vocabulary (each rank
holds V / tp columns): each chunk's cross-entropy is then torch's vocabulary-parallel one
(``loss_parallel``: the log-softmax's max and sum, and the target's logit, are all-reduced over
the tp ranks), so no rank ever holds a whole vocabulary's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from fsdp2lab.models.spec import logits_of

# The fp32 logits one chunk may hold: 523 tokens of a 128,256-token vocabulary; a byte-level
# model's whole batch up to 262,144 tokens. Each chunk is a dozen kernels forward and backward,
# launched from Python: a chunk must keep the GPU busy longer than the host takes to launch the
# next one (on an H200, 64 MiB chunks left the loss host-bound), and its transient (about four
# times its size) stays small beside a step's activations.
CHUNK_BYTES = 256 * 2**20
IGNORE_INDEX = -100  # F.cross_entropy's: targets that count in neither the loss nor its mean


def chunk_tokens_for(vocab: int) -> int:
    """Tokens per chunk for logits over ``vocab`` classes: ``CHUNK_BYTES`` of fp32 logits."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    weight: float = 1.0,
    root: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V), any float dtype, against ``target`` (...), in fp32,
    times ``weight``.

    ``reduction``: "mean" (over the targets that are not ``IGNORE_INDEX``) or "sum". At most
    ``chunk_tokens`` (default :func:`chunk_tokens_for` V) tokens' logits are upcast at a time;
    with no more tokens than that it is ``F.cross_entropy`` on the fp32 logits. ``logits`` may be
    a DTensor sharded on the vocabulary over the tp mesh: the loss is then vocabulary-parallel.
    ``root``: the caller's backward starts at the returned loss, with a gradient of 1 (a loss
    scaler's or anything else's backward through it must leave it False).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    # A chunk holds as many tokens whatever the tp degree: a rank's share of it is 1/tp.
    chunk = chunk_tokens or chunk_tokens_for(logits.shape[-1])
    flat, mesh = _rows(logits)
    flat_target = target.reshape(-1)
    if mesh is None and flat.shape[0] <= chunk:
        whole = F.cross_entropy(flat.float(), flat_target, reduction=reduction)
        return whole if weight == 1 else whole * weight
    needs_grad = torch.is_grad_enabled() and flat.requires_grad
    return _ChunkedCrossEntropy.apply(
        flat, flat_target, reduction == "mean", chunk, mesh, needs_grad, weight, root
    )


def correct(logits: torch.Tensor, target: torch.Tensor) -> float:
    """How many argmax predictions of ``logits`` (..., V) equal ``target`` (...); logits sharded
    on the vocabulary are gathered one chunk of tokens at a time."""
    flat, mesh = _rows(logits)
    chunk = chunk_tokens_for(logits.shape[-1])
    hits = torch.zeros((), dtype=torch.int64, device=flat.device)
    for piece, t in zip(flat.split(chunk), target.reshape(-1).split(chunk), strict=True):
        if mesh is not None:
            piece = DTensor.from_local(piece, mesh, [Shard(1)], run_check=False).full_tensor()
        hits += (piece.argmax(dim=-1) == t).sum()
    return float(hits)  # one device sync


def model_loss(
    output: Any,
    target: torch.Tensor,
    user_loss: Callable[[Any, Any], torch.Tensor] | None = None,
    reduction: str = "mean",
    weight: float = 1.0,
    root: bool = False,
) -> torch.Tensor:
    """The loss of a model's ``output`` times ``weight``: ``user_loss(output, target)`` (a mean
    over the batch; "sum" is that mean x ``target.numel()``) where given (``RunPlan.loss``), else
    :func:`cross_entropy` of its logits (``root``: see there)."""
    if user_loss is not None:
        mean = user_loss(_whole(output), target)
        factor = weight * (1 if reduction == "mean" else target.numel())
        return mean if factor == 1 else mean * factor
    return cross_entropy(logits_of(output), target, reduction, weight=weight, root=root)


def _whole(output: Any) -> Any:
    """``output`` with logits sharded on the vocabulary (TP) gathered whole, for a user's loss."""
    if isinstance(output, DTensor):
        return output.full_tensor()
    logits = getattr(output, "logits", None)
    if isinstance(logits, DTensor):
        output.logits = logits.full_tensor()  # transformers' ModelOutput: attribute and key
    return output


def _rows(logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(this rank's logits as (tokens, its vocabulary columns), the tp mesh); the mesh is None
    for a plain tensor. A DTensor must be sharded on its last dimension over a 1-D mesh."""
    if not isinstance(logits, DTensor):
        return logits.reshape(-1, logits.shape[-1]), None
    if tuple(logits.placements) != (Shard(logits.ndim - 1),):
        raise ValueError(
            f"logits as a DTensor must be sharded on the vocabulary (Shard(-1)) over the tp "
            f"mesh, not {logits.placements}"
        )
    local = logits.to_local()  # differentiable: the gradient flows back as the same DTensor
    return local.reshape(-1, local.shape[-1]), logits.device_mesh


def _piece_sum(piece: torch.Tensor, target: torch.Tensor, mesh) -> torch.Tensor:
    """One chunk's summed cross-entropy in fp32. With ``mesh`` (the tp mesh) ``piece`` is this
    rank's vocabulary columns, and the loss torch's vocabulary-parallel one (under
    :func:`_context`, forward and backward), the same value on every tp rank."""
    if mesh is None:
        return F.cross_entropy(piece.float(), target, reduction="sum")
    sharded = DTensor.from_local(piece.float(), mesh, [Shard(1)], run_check=False)
    return F.cross_entropy(sharded, target, reduction="sum").to_local()


def _context(mesh):
    return contextlib.nullcontext() if mesh is None else loss_parallel()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` over (N, V) logits, ``chunk`` rows at a time, forward and backward;
    with ``mesh`` (the tp mesh) the logits are this rank's (N, V / tp) columns (:func:`_piece_sum`).

    The loss is a step's last op, so where the logits need a gradient each chunk's is taken in
    forward, by ``F.cross_entropy``'s own backward right after its loss (of the fp32 chunk, with
    ``weight`` folded in), and written into the gradient in the logits' dtype (fp32: by that
    backward's last kernel; others: as it is copied, rounded once): one pass over every chunk instead of a forward pass and a second one, recomputed, in
    backward. Backward hands that gradient on as it is where ``root`` says its incoming gradient
    is 1; otherwise it scales it in place (rounded to the logits' dtype twice, within one ulp).
    fp16 logits take the gradient in backward, already scaled: a loss scaler's factor must come
    before the rounding to fp16, or the small gradients it is there for flush to zero.
    """

    @staticmethod
    def forward(
        ctx, logits, target, mean: bool, chunk: int, mesh, needs_grad: bool, weight, root: bool
    ):
        count = (target != IGNORE_INDEX).sum() if mean else None
        ctx.chunk, ctx.mesh, ctx.count, ctx.weight = chunk, mesh, count, weight
        ctx.fused = needs_grad and logits.dtype != torch.float16
        ctx.root = root and ctx.fused
        if ctx.fused:
            ctx.grad = torch.empty_like(logits)
            scale = _scale(count, weight)
            total = _sum_and_gradient(logits, target, chunk, mesh, scale, ctx.grad)
        else:
            ctx.save_for_backward(logits, target)
            with _context(mesh):
                total = _each_chunk(
                    lambda piece, t: _piece_sum(piece, t, mesh), chunk, logits, target
                )
        loss = total / count if mean else total
        return loss if weight == 1 else loss * weight

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.fused:
            if ctx.grad is None:
                raise RuntimeError(
                    "the chunked cross-entropy's gradient is taken in forward and scaled in "
                    "place: its backward runs once (no retain_graph=True through the loss)"
                )
            grad, ctx.grad = ctx.grad, None
            if not ctx.root:
                grad.mul_(grad_output)
            return grad, *(None,) * 7
        logits, target = ctx.saved_tensors
        # As F.cross_entropy's mean: its backward scales by grad_output / count.
        scale = grad_output * ctx.weight if ctx.weight != 1 else grad_output
        scale = scale if ctx.count is None else scale / ctx.count
        grad = torch.empty_like(logits)
        _sum_and_gradient(logits, target, ctx.chunk, ctx.mesh, scale, grad)
        return grad, *(None,) * 7


def _scale(count: torch.Tensor | None, weight: float) -> torch.Tensor | float | None:
    """What each chunk's summed loss is multiplied by in its gradient: ``weight`` over the
    mean's ``count``; None for 1."""
    if count is None:
        return None if weight == 1 else weight
    share = count.reciprocal()
    return share if weight == 1 else share * weight


def _sum_and_gradient(logits, target, chunk: int, mesh, scale, grad: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of ``logits``, ``chunk`` rows at a time, writing each chunk's
    gradient times ``scale`` (a 0-dim tensor; None: 1) into ``grad``."""

    def step(piece: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if mesh is None and out.dtype == torch.float32:
            return _fp32_chunk_sum_and_gradient(piece, t, scale, out)
        with torch.enable_grad(), _context(mesh):
            wide = piece.detach().float().requires_grad_()  # its gradient in fp32
            loss = _piece_sum(wide, t, mesh)
            (wide_grad,) = torch.autograd.grad(loss, wide, scale)
        out.copy_(wide_grad)  # rounded to the logits' dtype once, as it is written
        return loss.detach()

    return _each_chunk(step, chunk, logits, target, grad)


def _fp32_chunk_sum_and_gradient(piece, target, scale, out: torch.Tensor) -> torch.Tensor:
    """One fp32 chunk's summed cross-entropy, by ``F.cross_entropy``'s own kernels (log-softmax,
    NLL, and their backward), its gradient times ``scale`` written into ``out`` by log-softmax's
    backward itself: no copy. (That kernel writes a narrower dtype than its input on CUDA only:
    other dtypes take their gradient in fp32 and round it once as it is copied in.)"""
    log_probs = torch.log_softmax(piece.detach(), dim=-1)
    with torch.enable_grad():
        wide = log_probs.requires_grad_()
        loss = F.nll_loss(wide, target, reduction="sum")
        (log_probs_grad,) = torch.autograd.grad(loss, wide, scale)
    # aten's log-softmax backward with an output: the op F.cross_entropy's backward ends with.
    torch.ops.aten._log_softmax_backward_data.out(
        log_probs_grad, log_probs.detach(), -1, out.dtype, out=out
    )
    return loss.detach()


def _each_chunk(step: Callable, chunk: int, *tensors: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of ``step`` over ``tensors`` cut into ``chunk`` rows at a time (the chunks'
    values summed once, at the end). Every chunk frees what it makes but its value, and all but
    the last are alike: the plan's simulation runs the first and the last, and counts the first's
    ops again for those between."""
    sums = [step(*pieces) for pieces in zip(*(t.split(chunk) for t in tensors), strict=True)]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()
