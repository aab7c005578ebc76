"""``--on-nan stop|skip``: a non-finite loss or gradient never reaches the weights or a checkpoint.

Between backward and the optimizer step every rank folds its loss and its (local shards of the)
gradients into one finiteness flag (``torch._foreach_norm`` with ord inf: one fused pass, no
overflow, NaN propagates), one one-element all-reduce (MAX) makes it global and one host read
gives the verdict. On a step that computes the gradient norm over one all-reduce of every rank
(plain FSDP; ``parallel/grad_norm.py``) the loss rides on that all-reduce and the norm is the
verdict: no collective of the guard's own. Only on a bad step a second all-reduce (of two flags) tells the loss from the
gradients in the message.

``stop`` raises ``TrainingFailed`` before the update: no checkpoint of that step or later is saved,
and ``--resume auto`` restarts from the newest one, all finite. ``skip`` drops the step's update:
gradients zeroed, no optimizer or scheduler step, so weights, optimizer state and schedule stay
those of the step before; the step counts and its global batch is consumed.

With fp16 the gradient scaler owns the gradients: an overflow there is routine (it skips that
update and lowers its scale), so only the loss is checked. A skipped step under fp16 also lets the
scaler record it as an overflow (its scale backs off, as after any inf).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2lab.errors import TrainingFailed
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training.hooks import Hooks

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


log = logs.get_logger(__name__)


def _nonfinite(tensors, device: torch.device) -> torch.Tensor:
    """1.0 if this rank's part of any tensor (None: skipped) is not finite, else 0.0 (no sync).

    The largest magnitude of each tensor (``_foreach_norm``, ord inf) is finite exactly when all
    its elements are: one fused read of every tensor, no mask its size, no overflow of a sum. One
    call per device (``--cpu-offload`` keeps gradients on the host, the loss on the GPU); the flag
    is on ``device``, which the all-reduce reduces.
    """
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        if t.numel() > 0:
            by_device.setdefault(t.device, []).append(t.detach())
    if not by_device:
        return torch.zeros((), device=device)
    peaks = [p for group in by_device.values() for p in torch._foreach_norm(group, float("inf"))]
    peaks = torch.stack([p.to(device=device, dtype=torch.float32) for p in peaks])
    return (~torch.isfinite(peaks)).any().float()


def _on_any_rank(flags: torch.Tensor) -> list[bool]:
    """Which of ``flags`` (0/1 values) are set on some rank: one all-reduce, one host read."""
    flags = flags.reshape(-1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def all_finite(tensors, device: torch.device) -> bool:
    """Whether every tensor on every rank is finite (a collective)."""
    return not _on_any_rank(_nonfinite(tensors, device))[0]


class NanGuard(Hooks):
    def __init__(self, runtime: Runtime, policy: str):
        self.runtime, self.policy = runtime, policy

    def before_optimizer_step(self, trainer: Trainer, loss: torch.Tensor) -> bool:
        device = trainer.device
        grads = [] if trainer.scaler else [p.grad for p in trainer.model.parameters()]
        if trainer.step_norm_checks:  # every rank's loss rode on the norm's all-reduce
            if torch.isfinite(trainer.last_grad_norm).item():
                return False
        elif not _on_any_rank(_nonfinite([loss, *grads], device))[0]:
            return False
        # The rare bad step: which was it (one more all-reduce, now that the step is lost anyway)?
        bad = _on_any_rank(torch.stack([_nonfinite([loss], device), _nonfinite(grads, device)]))
        what = " and ".join(w for w, b in zip(("loss", "gradient"), bad, strict=True) if b)
        step = trainer.state.step + 1
        if self.policy == "stop":
            raise TrainingFailed(
                f"non-finite {what} at step {step}: training stopped before its update "
                f"(--on-nan stop); no checkpoint holds it, --resume auto takes the newest"
            )
        if self.runtime.is_main:  # every rank skips; one line says so
            log.warning(
                f"fsdp2lab: non-finite {what} at step {step}: update skipped (--on-nan skip)"
            )
        return True
