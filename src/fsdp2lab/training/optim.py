"""Optimizers and LR schedules from the config (the seed's recipe: Adadelta lr 1.0 + StepLR gamma 0.7)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from fsdp2lab.config import TrainConfig
from fsdp2lab.parallel.local_step import step_on_local_shards


def build_optimizer(params, cfg: TrainConfig, local_step: bool = True) -> torch.optim.Optimizer:
    """The configured optimizer over the parameters that train (a LoRA run's frozen base gets no
    state); on DTensor parameters (FSDP2, HSDP, TP) it steps on the local shards unless
    ``local_step`` is False (benchmarks compare the two)."""
    optimizer = _optimizer([p for p in params if p.requires_grad], cfg)
    if local_step:
        step_on_local_shards(optimizer)
    return optimizer


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can drop its update by a flag on the device, with no host read, and
    divide its gradients inside its own kernel: torch's fused implementations read ``found_inf``
    and ``grad_scale`` (as a GradScaler sets them) in their kernel."""
    return bool(optimizer.defaults.get("fused"))


def clips_in_step(optimizer: torch.optim.Optimizer, scaler=None) -> bool:
    """Whether gradient clipping can ride on the optimizer step (``grad_divisor`` of
    :func:`step`) instead of a pass of its own over the gradients: a fused step that no GradScaler
    owns (a scaler divides by its own scale)."""
    return scaler is None and skips_on_device(optimizer)


def step(
    optimizer: torch.optim.Optimizer,
    dropped: torch.Tensor | None = None,
    grad_divisor: torch.Tensor | None = None,
) -> None:
    """``optimizer.step()``; where ``dropped`` (a 0-dim 1.0/0.0 tensor) is 1.0 the update, the
    optimizer's own step count included, is dropped on the device (``skips_on_device``); every
    gradient is divided by ``grad_divisor`` (a 0-dim tensor) as the fused kernel reads it
    (``clips_in_step``: clipping with no pass of its own)."""
    given = {"found_inf": dropped, "grad_scale": grad_divisor}
    given = {name: value.float() for name, value in given.items() if value is not None}
    for name, value in given.items():
        setattr(optimizer, name, value)
    try:
        optimizer.step()
    finally:
        for name in given:
            delattr(optimizer, name)


def _optimizer(params: list, cfg: TrainConfig) -> torch.optim.Optimizer:
    lr = cfg.lr
    wd = cfg.weight_decay
    if cfg.optimizer == "adadelta":
        return torch.optim.Adadelta(params, lr=lr, weight_decay=wd)
    # Adam(W) fused: one kernel per step over all parameters.
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd, fused=True)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> tuple[LRScheduler, str]:
    """The schedule and when it steps: ``"epoch"`` (StepLR, as in the seed) or ``"step"``."""
    if cfg.scheduler == "step":
        return StepLR(optimizer, step_size=1, gamma=cfg.gamma), "epoch"
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor), "step"
