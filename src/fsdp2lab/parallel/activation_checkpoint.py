"""Activation checkpointing per sharding unit, in place: parameter names do not change.

``apply_activation_checkpointing(model, units, mode)`` makes each chosen unit (a module FQN such
as ``"blocks.0"``) keep only its inputs from forward (under ``op``: and the outputs of the ops
that mode keeps) and run its forward again in backward.

How: the unit's ``forward`` is replaced, on the instance, by one that calls the original through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (under ``op`` with
``context_fn=op_sac_context``). No wrapper module is inserted
(``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to every parameter name), so
``named_parameters()``, ``state_dict()`` and DCP keys are the same with and without AC, and a
checkpoint saved with one loads with the other.

Order with the other wrappers (TP -> AC -> compile -> ``fully_shard``): module hooks run in
``Module.__call__`` around ``forward``, so FSDP2's pre/post-forward hooks (all-gather, reshard)
stay outside the checkpointed region, exactly as with torchtitan's wrapper module. In backward,
FSDP2's pre-backward hook all-gathers the unit's parameters before autograd reaches the
checkpoint, so the recomputed forward sees full parameters. The non-reentrant checkpoint saves
and restores the RNG state, so dropout draws the same mask again on recompute.

Modes:

* ``none``: nothing changes.
* ``full``: every unit recomputes its forward in backward.
* ``selective``: every other unit, counted over ``units`` in order: positions 0, 2, 4, ... (the
  first unit, the third, ...), as torchtitan's per-layer selective AC with frequency 2. Half the
  units' activations are kept, half recomputed: about half of full AC's memory saving for about
  half of its extra compute.
* ``op``: every unit, per op, as torchtitan's per-op selective AC: the unit keeps the outputs of
  attention (``scaled_dot_product_attention``'s flash, efficient, cuDNN and CPU flash kernels),
  of every other matmul (the 1st, 3rd, ... in the unit's forward; the others are recomputed)
  and of reduce-scatters (tensor parallelism's functional collective), and recomputes the rest
  (norms, activations, rotary embeddings, elementwise ops): attention runs once, half the
  matmuls and the cheap ops twice.

A matmul is ``aten.mm`` or ``aten.addmm``: ``nn.Linear`` without a bias dispatches ``mm`` (of the
input flattened to 2-D), with one ``addmm`` (the bias added in the same kernel; ``mm`` and
``add`` for a non-contiguous input of more than 2 dimensions), in any dtype. torchtitan counts
``mm`` only, which is the same for its bias-free models; counting ``addmm`` too gives a linear
layer with a bias the same policy. Batched matmuls (``bmm``: an
attention written by hand, the math fallback of ``scaled_dot_product_attention``) are
recomputed. The policy sees each op as it is dispatched at the unit's level: under ``--tp`` a
``nn.Linear`` is one ``mm`` on DTensors (the local ``mm`` inside DTensor's dispatch is not seen
again), so the count is the same as without TP.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdp2lab.config import AC_MODES
from fsdp2lab.errors import UsageError

__all__ = [
    "AC_MODES",
    "OP_SAC_MATMULS",
    "OP_SAC_SAVED",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpointed_units",
    "is_checkpointed",
    "op_sac_context",
    "op_sac_policy",
]
_MARK = "_fsdp2lab_checkpointed"

_aten = torch.ops.aten
# Per-op AC: every other matmul's output is kept, every output of these ops is kept.
OP_SAC_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
OP_SAC_SAVED = frozenset(
    {
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        _aten.max.default,  # a whole tensor's max: a quantisation scale, as torchtitan keeps it
    }
)


def op_sac_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy of per-op AC (mode ``op``) for one checkpointed call, as
    ``create_selective_checkpoint_contexts`` takes it: ``MUST_SAVE`` for the 1st, 3rd, ...
    matmul and the ops of ``OP_SAC_SAVED``, ``PREFER_RECOMPUTE`` for the rest. Matmuls are
    counted apart in the forward and in the recompute, so both keep the same ones (torch asks
    the policy again in the recompute up to pytorch#176455; later it replays the forward's)."""
    counts = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in OP_SAC_MATMULS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in OP_SAC_SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_sac_context() -> tuple[Any, Any]:
    """The ``context_fn`` of per-op AC: the forward and recompute contexts of one checkpointed
    call, under a fresh ``op_sac_policy``."""
    return create_selective_checkpoint_contexts(op_sac_policy())


def checkpointed_units(units: list[str], mode: str) -> list[str]:
    """The units ``mode`` recomputes in backward (a subset of ``units``, in order)."""
    if mode not in AC_MODES:
        raise UsageError(
            f"--activation-checkpointing must be one of {', '.join(AC_MODES)}, not {mode!r}"
        )
    if mode == "none":
        return []
    if mode in ("full", "op"):
        return list(units)
    return list(units[::2])


def _checkpoint(fn: Any, ops: bool, *args: Any, **kwargs: Any) -> Any:
    if ops:
        kwargs["context_fn"] = op_sac_context
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The instance-level ``forward`` of a checkpointed unit: its class's forward, recomputed."""
    return _checkpoint(type(self).forward, getattr(self, _MARK) == "op", self, *args, **kwargs)


def checkpoint_module(module: nn.Module, mode: str = "full") -> None:
    """Make ``module`` recompute its forward in backward (``mode`` ``"full"``: all of it;
    ``"op"``: all but the ops per-op AC keeps); its parameters and buffers keep their names.
    Idempotent: a module already checkpointed keeps its mode.

    The instance's ``forward`` becomes a method bound to the module (so ``copy.deepcopy`` binds
    the copy's to the copy) that runs the class's ``forward`` under a non-reentrant checkpoint.
    A forward already set on the instance is wrapped as it is.
    """
    if mode not in ("full", "op"):
        raise ValueError(f"checkpoint_module: mode must be 'full' or 'op', not {mode!r}")
    if getattr(module, _MARK, False):
        return
    inner = module.__dict__.get("forward")
    if inner is None:
        module.forward = types.MethodType(_checkpointed_forward, module)
    else:

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return _checkpoint(inner, mode == "op", *args, **kwargs)

        module.forward = forward
    setattr(module, _MARK, mode)


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def apply_activation_checkpointing(model: nn.Module, units: list[str], mode: str) -> None:
    """Checkpoint the units of ``model`` (module FQNs) that ``mode`` selects, in place.

    Call it after tensor parallelism and before ``compile_units`` and ``fully_shard``.
    """
    chosen = checkpointed_units(units, mode)
    for fqn in chosen:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise UsageError(f"activation checkpointing: the model has no module {fqn!r}") from None
        if module is model:
            # The root's forward is the whole step: recomputing it saves nothing.
            raise UsageError("activation checkpointing needs sub-module units, not the root model")
        checkpoint_module(module, "op" if mode == "op" else "full")
