"""``torch.compile`` per sharding unit, in place: parameter names do not change.

``compile_units(model, units)`` calls ``module.compile()`` on each unit (a module FQN such as
``"blocks.0"``). Unlike ``torch.compile(module)``, which returns an ``OptimizedModule`` wrapper
whose parameters are named ``_orig_mod.*``, ``Module.compile()`` compiles the module's own call in
place, so ``named_parameters()``, ``state_dict()`` and DCP keys are unchanged.

Compiling per unit (torchtitan's way) rather than the whole model: the units of a transformer are
alike, so dynamo compiles one graph and reuses it for the others; the code between units
(embedding, head, loss) stays eager.

Order: TP -> activation checkpointing -> compile -> ``fully_shard``. FSDP2's hooks, registered
afterwards on the same module, are excluded from dynamo (``torch._dynamo.disable``), so they run
eagerly around the compiled forward; a checkpointed forward is traced as one checkpoint region.

Inductor needs a C++ compiler on CPU (and Triton on CUDA). ``check_compile_support`` tells, in one
line, why compiling cannot work here; ``compile_units`` raises it as a ``UsageError`` before any
training starts instead of failing at the first forward.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn

from fsdp2lab.errors import UsageError


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU, or None."""
    try:
        from torch._inductor import cpp_builder

        return cpp_builder.get_cpp_compiler()
    except (ImportError, AttributeError):  # pragma: no cover - private API moved: look ourselves
        for cxx in (os.environ.get("CXX"), "g++", "clang++"):
            if cxx and shutil.which(cxx):
                return cxx
        return None
    except Exception:  # inductor's InvalidCxxCompiler, or the compiler failed to run
        return None


def check_compile_support(device_type: str, backend: str = "inductor") -> str | None:
    """Why ``torch.compile`` with ``backend`` cannot work on ``device_type``; None when it can."""
    if backend != "inductor":
        return None
    if device_type == "cpu":
        if _cpp_compiler() is None:
            cxx = os.environ.get("CXX") or "g++"
            return (
                f"--compile on CPU needs a C++ compiler for inductor, and none works here "
                f"(looked for {cxx}; install g++ or set CXX, or drop --compile)"
            )
    elif device_type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover
            return None
        if not has_triton():
            return "--compile on CUDA needs Triton for inductor, and it is not installed (pip install triton, or drop --compile)"
    return None


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def compile_units(
    model: nn.Module,
    units: list[str],
    *,
    device_type: str | None = None,
    backend: str = "inductor",
    fullgraph: bool = False,
) -> None:
    """Compile each unit of ``model`` (module FQNs) in place with ``Module.compile``.

    ``device_type`` is where the model will run (default: where its parameters are; a model on
    the meta device is checked as CPU). Raises ``UsageError`` when compiling cannot work there.
    Call it after TP and activation checkpointing, before ``fully_shard``.
    """
    device_type = device_type or _device_type(model)
    if device_type == "meta":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    reason = check_compile_support(device_type, backend)
    if reason:
        raise UsageError(reason)
    for fqn in units:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise UsageError(f"compile: the model has no module {fqn!r}") from None
        module.compile(backend=backend, fullgraph=fullgraph)
