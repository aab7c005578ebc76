"""Activation checkpointing per sharding unit, in place: parameter names do not change.

``apply_activation_checkpointing(model, units, mode)`` makes each chosen unit (a module FQN such
as ``"blocks.0"``) keep only its inputs from forward and run its forward again in backward.

How: the unit's ``forward`` is replaced, on the instance, by one that calls the original through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. No wrapper module is inserted
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
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp2lab.config import AC_MODES
from fsdp2lab.errors import UsageError

__all__ = [
    "AC_MODES",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpointed_units",
    "is_checkpointed",
]
_MARK = "_fsdp2lab_checkpointed"


def checkpointed_units(units: list[str], mode: str) -> list[str]:
    """The units ``mode`` recomputes in backward (a subset of ``units``, in order)."""
    if mode not in AC_MODES:
        raise UsageError(
            f"--activation-checkpointing must be one of {', '.join(AC_MODES)}, not {mode!r}"
        )
    if mode == "none":
        return []
    if mode == "full":
        return list(units)
    return list(units[::2])


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The instance-level ``forward`` of a checkpointed unit: its class's forward, recomputed."""
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` recompute its forward in backward; its parameters and buffers keep their
    names. Idempotent.

    The instance's ``forward`` becomes a method bound to the module (so ``copy.deepcopy`` binds
    the copy's to the copy) that runs the class's ``forward`` under a non-reentrant checkpoint.
    A forward already set on the instance is wrapped as it is.
    """
    if getattr(module, _MARK, False):
        return
    inner = module.__dict__.get("forward")
    if inner is None:
        module.forward = types.MethodType(_checkpointed_forward, module)
    else:

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
    setattr(module, _MARK, True)


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
        checkpoint_module(module)
