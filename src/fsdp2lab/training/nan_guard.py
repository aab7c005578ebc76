"""``--on-nan stop|skip``: a non-finite loss or gradient never reaches the weights or a checkpoint.

Between backward and the optimizer step every rank checks its loss and its (local shards of the)
gradients, and one all-reduce (MAX) of two flags makes the verdict global, so all ranks agree.
``stop`` raises ``TrainingFailed`` before the update: no checkpoint of that step or later is saved,
and ``--resume auto`` restarts from the newest one, all finite. ``skip`` drops the step's update
(gradients zeroed; no optimizer or scheduler step) and says so; the step still counts.
With fp16 the gradient scaler already skips steps whose gradients overflowed: only the loss is
checked then.
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

    A tensor's least and greatest elements are both finite exactly when all its elements are
    (NaN propagates through both): one read of each tensor, where ``isfinite`` writes a mask
    its size (1.2 M gradients: 0.14 against 2.5 ms here).
    """
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    ends = [
        torch.stack(torch.aminmax(t.detach())).float().to(device) for t in local if t.numel() > 0
    ]
    if not ends:
        return torch.zeros((), device=device)
    return (~torch.isfinite(torch.cat(ends))).any().float()


def _on_any_rank(flags: torch.Tensor) -> list[bool]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def all_finite(tensors, device: torch.device) -> bool:
    """Whether every tensor on every rank is finite (a collective)."""
    return not _on_any_rank(_nonfinite(tensors, device).reshape(1))[0]


class NanGuard(Hooks):
    def __init__(self, runtime: Runtime, policy: str):
        self.runtime, self.policy = runtime, policy

    def before_optimizer_step(self, trainer: Trainer, loss: torch.Tensor) -> bool:
        device = trainer.device
        grads = [] if trainer.scaler else [p.grad for p in trainer.model.parameters()]
        bad = _on_any_rank(torch.stack([_nonfinite([loss], device), _nonfinite(grads, device)]))
        if not any(bad):
            return False
        step = trainer.state.step + 1
        what = " and ".join(w for w, b in zip(("loss", "gradient"), bad, strict=True) if b)
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
