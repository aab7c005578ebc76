"""Meta-device construction and deterministic initialisation that does not depend on sharding.

The model is built on the meta device (no memory), parallelised, moved with ``to_empty`` to its
device, then initialised here one module at a time: each module's full tensors are made on CPU from a
generator seeded by (seed, module name), and each rank copies in only the part it holds. So the
initial full weights are identical for every strategy, mesh and world size, and no rank ever holds
more than one full layer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from fsdp2lab.models.nf4 import is_nf4, quantize_into

# What fills a tensor with values in place, which a model's constructor runs to initialise its
# parameters: ``torch.nn.init``'s functions (Hugging Face wraps them while it builds a model, so by
# name), and the tensor methods they call.
FILLS = frozenset(
    [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    + ["normal_", "uniform_", "zero_", "fill_", "copy_", "erfinv_", "mul_", "add_", "clamp_"]
)


class _NoFillsOnMeta(TorchFunctionMode):
    """Skips ``FILLS`` on meta tensors, which hold no values: what they would fill is left to
    :func:`init_weights` after ``to_empty``. (Run on meta, torch's Python decompositions of them
    take most of building a model: a tenth of a second for a 32-layer Llama.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def build_on_meta(factory: Callable[[], nn.Module], real_buffers: bool = False) -> nn.Module:
    """The model with its tensors on the meta device (no memory; nothing filled in).

    ``real_buffers``: only the parameters go to meta, each as soon as it is registered; buffers
    keep the values the model computed (e.g. a rotary embedding's ``inv_freq``, which no init
    function could rebuild), and are copied in after ``to_empty``.
    """
    with _NoFillsOnMeta():
        return _build_on_meta(factory, real_buffers)


def _build_on_meta(factory: Callable[[], nn.Module], real_buffers: bool) -> nn.Module:
    if not real_buffers:
        with torch.device("meta"):
            return factory()
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta
    try:
        return factory()
    finally:
        nn.Module.register_parameter = register


def to_empty(model: nn.Module, device) -> nn.Module:
    """``model.to_empty(device=...)`` that keeps tied parameters tied (an embedding shared with the
    output head): moving off the meta device makes a new Parameter per module, untying them."""
    tied: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for places in tied.values():
        first_module, first_name = places[0]
        shared = getattr(first_module, first_name)
        for module, name in places[1:]:
            if getattr(module, name) is not shared:
                setattr(module, name, shared)
    return model


def module_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_module(root: nn.Module, fqn: str, module: nn.Module) -> None:
    custom = getattr(root, "init_module", None)
    # A Hugging Face model's own initialiser. Called directly, not through HF's
    # ``_initialize_weights``: that skips modules flagged ``_is_hf_initialized``, which
    # ``post_init`` sets on every module at construction (here: on the meta device). The fresh
    # tensors ``to_empty`` made carry no such flag, so its guarded ``init.*`` functions write them.
    hf_init = getattr(root, "_init_weights", None)
    if custom is not None:
        custom(fqn, module)
    elif hf_init is not None:
        with torch.no_grad():
            hf_init(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise TypeError(
            f"module {fqn or '<root>'} ({type(module).__name__}) has parameters but no reset_parameters()"
        )


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the part of ``full`` that this rank holds into ``target`` (a DTensor shard or a plain
    tensor; an NF4 one: quantized, ``nf4.quantize_into``)."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            src = full.to(device=target.device_mesh.device_type, dtype=target.dtype)
            local = distribute_tensor(
                src, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
        else:
            local = full.to(target.dtype)
        if is_nf4(target):
            quantize_into(target, local)
        elif isinstance(target, DTensor):
            target.to_local().copy_(local)
        else:
            target.copy_(local)


def init_weights(model: nn.Module, reference: nn.Module, seed: int) -> None:
    """Initialise ``model`` (already ``to_empty``-ed, possibly sharded) from the meta ``reference``.

    ``reference`` is an unparallelised meta copy of the same architecture: its modules give the
    full shapes and the init functions. Modules ``model`` does not hold (another pipeline stage's)
    are skipped; every tensor ``model`` does hold must be initialised.
    """
    done: set[int] = set()
    for fqn, ref_module in reference.named_modules():
        own = dict(ref_module.named_parameters(recurse=False))
        own.update(dict(ref_module.named_buffers(recurse=False)))
        prefix = f"{fqn}." if fqn else ""
        targets = {name: _lookup(model, prefix + name) for name in own}
        if not own or all(t is None for t in targets.values()):
            continue
        real = {n: t for n, t in ref_module.named_buffers(recurse=False) if not t.is_meta}
        # The reference's own tensors, put back afterwards: the same objects, so that a tied
        # parameter stays tied there (a model built from the reference again is tied too).
        params, buffers = dict(ref_module._parameters), dict(ref_module._buffers)
        try:
            if len(real) < len(own):  # real buffers (build_on_meta(real_buffers=True)) are kept
                ref_module.to_empty(device="cpu", recurse=False)
                blank = _poison(ref_module, real)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(module_seed(seed, fqn))
                    _init_module(reference, fqn, ref_module)
                ref_module._buffers.update(real)
                _check_initialised(reference, fqn, ref_module, blank)
            for name, target in targets.items():
                if target is None:
                    raise KeyError(f"{prefix + name} not found in the parallelised model")
                _copy_into(target, getattr(ref_module, name))
                done.add(id(target))
        finally:
            ref_module._parameters.update(params)
            ref_module._buffers.update(buffers)
    missed = [
        n for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in done
    ]
    if missed:
        raise KeyError(f"not initialised (no such module in the reference model): {missed}")


def _poison(module: nn.Module, real: dict[str, torch.Tensor]) -> list[str]:
    """Fill the module's fresh floating-point tensors with NaN (``to_empty`` memory may hold
    anything, even an earlier module's weights): what its init leaves unset stays NaN."""
    names = [
        name
        for name, t in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]
        if name not in real and t.is_floating_point()
    ]
    with torch.no_grad():
        for name in names:
            getattr(module, name).fill_(float("nan"))
    return names


def _check_initialised(root: nn.Module, fqn: str, module: nn.Module, names: list[str]) -> None:
    left = [n for n in names if torch.isnan(getattr(module, n)).any()]
    if left:
        how = (
            "init_module"
            if hasattr(root, "init_module")
            else "_init_weights"
            if hasattr(root, "_init_weights")
            else "reset_parameters"
        )
        raise ValueError(
            f"module {fqn or '<root>'} ({type(module).__name__}): its initialisation ({how}) "
            f"left {', '.join(left)} unset (or NaN); give the model an init_module(fqn, module) "
            "that sets every tensor of the module"
        )


def _lookup(model: nn.Module, name: str) -> torch.Tensor | None:
    """A parameter or buffer by its unwrapped name (wrappers such as DDP or PP stages add prefixes)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        pass
    try:
        return model.get_buffer(name)
    except AttributeError:
        pass
    for key, value in list(model.named_parameters()) + list(model.named_buffers()):
        if key.replace("_checkpoint_wrapped_module.", "").replace("module.", "", 1) == name:
            return value
    return None
