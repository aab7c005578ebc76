"""``--on-nan stop|skip``: a non-finite loss or gradient never reaches the weights or a checkpoint.

Between backward and the optimizer step every rank folds its loss and its (local shards of the)
gradients into two finiteness flags (``torch._foreach_norm`` with ord inf: one fused pass, no
overflow, NaN propagates), and one all-reduce (MAX) makes them global. On a step that computes the
gradient norm over one all-reduce of every rank (plain FSDP; ``parallel/grad_norm.py``) the loss's
flag rides on that all-reduce and the norm is the gradients' flag: no collective of the guard's own.

The verdict stays on the device. With an optimizer that takes a device flag (torch's fused Adam and
AdamW, as under a GradScaler: ``found_inf``) the update is dropped there, and the host reads the
flags later, at the next step record, epoch end or checkpoint (``settle``), when they are ready: a
step that writes no record waits for nothing. ``stop`` drops every update from the bad step on and
raises ``TrainingFailed`` at that read, naming the bad step; no checkpoint is saved after it, and
``--resume auto`` restarts from the newest one, all finite. ``skip`` drops that step's update only:
no optimizer step (Adam's own step count stays), so weights and optimizer state stay those of the
step before; the step counts, its global batch is consumed and the schedule moves on, as after a
GradScaler's skipped step. One line per skipped step says so.

Other optimizers (Adadelta, SGD) and fp16, whose scaler owns the gradients, read the verdict on the
host every step (one device sync). With fp16 an overflow is routine (the scaler skips that update
and lowers its scale), so only the loss is checked; a skipped step also lets the scaler record it
as an overflow (its scale backs off, as after any inf).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2lab.errors import TrainingFailed
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.runtime.torch_compat import local_tensor
from fsdp2lab.training.device_reads import AsyncRead
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.optim import skips_on_device

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


log = logs.get_logger(__name__)


@torch.no_grad()
def _nonfinite(groups: list[list], device: torch.device) -> torch.Tensor:
    """Per group of tensors (None: skipped), 1.0 if this rank's part of any is not finite, else
    0.0: a tensor of one value per group on ``device`` (no sync).

    The largest magnitude of each tensor (``_foreach_norm``, ord inf) is finite exactly when all
    its elements are: one fused read of every tensor, no mask its size, no overflow of a sum. One
    call per group and device (``--cpu-offload`` keeps gradients on the host, the loss on the
    GPU); the flags are on ``device``, which the all-reduce reduces.
    """
    peaks: list[torch.Tensor] = []
    bounds = []
    for group in groups:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in group:
            local = local_tensor(t) if isinstance(t, DTensor) else t
            if local is not None and local.numel() > 0:
                by_device.setdefault(local.device, []).append(local)
        start = len(peaks)
        for tensors in by_device.values():
            peaks += torch._foreach_norm(tensors, float("inf"))
        bounds.append((start, len(peaks)))
    if not peaks:
        return torch.zeros(len(groups), device=device)
    bad = ~torch.isfinite(torch.stack([p.to(device=device, dtype=torch.float32) for p in peaks]))
    none = torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([bad[s:e].any() if e > s else none for s, e in bounds]).float()


def _on_any_rank(flags: torch.Tensor) -> list[bool]:
    """Which of ``flags`` (0/1 values) are set on some rank: one all-reduce, one host read."""
    flags = flags.reshape(-1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def all_finite(tensors, device: torch.device) -> bool:
    """Whether every tensor on every rank is finite (a collective)."""
    return not _on_any_rank(_nonfinite([list(tensors)], device))[0]


def trained_weights_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every parameter that trains is finite on every rank (a collective). A frozen base
    (LoRA's; QLoRA's NF4, which has no norm) never changes, so it is not read."""
    return all_finite((p for p in model.parameters() if p.requires_grad), device)


class NanGuard(Hooks):
    # Verdicts are sent to the host at least this often (bounded memory), and at step records.
    SEND_EVERY = 100

    def __init__(self, runtime: Runtime, policy: str):
        self.runtime, self.policy = runtime, policy
        self.unsent: list[tuple[int, torch.Tensor]] = []  # (step, its global [loss, grad] flags)
        self.sent: list[tuple[list[int], AsyncRead]] = []  # on their way to the host
        self.dropping: torch.Tensor | None = None  # ``stop``: 1.0 once a bad step was seen

    def before_optimizer_step(self, trainer: Trainer, loss: torch.Tensor) -> bool | torch.Tensor:
        device = trainer.device
        if trainer.step_loss_verdict is not None:  # every rank's loss rode on the norm's all-reduce
            verdict = trainer.step_loss_verdict.float()
            grad_flag = (~torch.isfinite(trainer.last_grad_norm)).float().to(verdict.device)
            flags = torch.stack([verdict, grad_flag])
        else:
            grads = [] if trainer.scaler else [p.grad for p in trainer.model.parameters()]
            flags = _nonfinite([[loss], grads], device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        step = trainer.state.step + 1
        if trainer.scaler is not None or not skips_on_device(trainer.optimizer):
            return self._verdict([step], [flags.tolist()])  # read now: one sync a step
        self.unsent.append((step, flags))
        bad = flags.amax()
        if self.policy == "stop":  # every update from the first bad step on is dropped
            bad = bad if self.dropping is None else torch.maximum(bad, self.dropping)
            self.dropping = bad
        return bad

    def after_step(self, trainer: Trainer) -> None:
        if trainer.logs_step(trainer.state.step) or len(self.unsent) >= self.SEND_EVERY:
            self._send()
        while self.sent and self.sent[0][1].ready():
            self._read_first()

    def settle(self, trainer: Trainer) -> None:
        self._send()
        while self.sent:
            self._read_first()

    def _send(self) -> None:
        if self.unsent:
            steps = [step for step, _ in self.unsent]
            self.sent.append((steps, AsyncRead(torch.stack([f for _, f in self.unsent]))))
            self.unsent = []

    def _read_first(self) -> None:
        steps, read = self.sent.pop(0)
        self._verdict(steps, read.values())

    def _verdict(self, steps: list[int], flags: list[list[float]]) -> bool:
        """Raise (``stop``) or log (``skip``) for the first or each bad step of ``steps``, whose
        [loss, gradient] flags are ``flags``; whether one was bad."""
        any_bad = False
        for step, (loss_bad, grad_bad) in zip(steps, flags, strict=True):
            if not (loss_bad or grad_bad):
                continue
            any_bad = True
            what = " and ".join(w for w, b in (("loss", loss_bad), ("gradient", grad_bad)) if b)
            if self.policy == "stop":
                raise TrainingFailed(
                    f"non-finite {what} at step {step}: training stopped before its update "
                    f"(--on-nan stop); no checkpoint holds it, --resume auto takes the newest"
                )
            if self.runtime.is_main:  # every rank skips; one line says so
                log.warning(
                    f"fsdp2lab: non-finite {what} at step {step}: update skipped (--on-nan skip)"
                )
        return any_bad
