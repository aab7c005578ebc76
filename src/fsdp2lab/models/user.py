"""Your own model: ``--model pkg.module:NAME`` or ``--model path/to/file.py:NAME``.

``NAME`` is either a :class:`~fsdp2lab.models.spec.ModelSpec` (the model says everything about
itself, as the built-in models do: units, TP plan, pipeline) or a factory that returns an
``nn.Module``; a factory is called with the ``--model-args 'k=v,...'`` keywords, and its model gets
its sharding units inferred (the most repeated block class, or ``--fsdp-unit-class``). Its task
follows the data: ``--input-shape C,H,W`` makes it a classifier of ``--num-classes`` classes;
otherwise it is a language model over ``--vocab-size`` tokens of ``--seq-len``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import sys
from importlib import import_module
from pathlib import Path

import torch.nn as nn

from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec, infer_units

ALL_DATASETS = ("mnist", "fashion-mnist", "cifar10", "synthetic", "text", "tokens")


# Prefixes of pretrained models and token files: they win over the ``module:attr`` form.
PREFIXES = ("hf:", "tokens:")


def is_reference(name: str) -> bool:
    """``module:attr`` or ``file.py:attr`` (a built-in model name has no colon)."""
    return ":" in name and not name.startswith(PREFIXES)


def load_object(reference: str, what: str):
    """The object ``reference`` (``pkg.module:attr`` or ``path/file.py:attr``) names."""
    where, _, attr = reference.rpartition(":")
    if not where or not attr:
        raise UsageError(f"{what} {reference!r}: expected MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py") and not Path(where).is_file():
        raise UsageError(f"{what} {reference!r}: no such file {where}")
    try:
        module = _import_file(Path(where)) if where.endswith(".py") else import_module(where)
    except Exception as e:  # the user's code: any error it raises on import
        raise UsageError(
            f"{what} {reference!r}: cannot import {where}: {type(e).__name__}: {e}"
        ) from None
    if not hasattr(module, attr):
        raise UsageError(f"{what} {reference!r}: {where} has no {attr!r}")
    return getattr(module, attr)


def _import_file(path: Path):
    """Import a file once per process; its folder goes on ``sys.path`` (for its own imports)."""
    path = path.resolve()
    name = f"fsdp2lab_user_{path.stem}_{abs(hash(str(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def parse_model_args(text: str) -> dict:
    """``'d=64,tied=true,name=x'`` -> ``{"d": 64, "tied": True, "name": "x"}`` (JSON values, else str)."""
    out: dict = {}
    # A comma starts a new pair only before ``name=`` (so JSON lists keep theirs).
    for item in filter(None, (p.strip() for p in re.split(r",(?=\s*[A-Za-z_]\w*\s*=)", text))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--model-args: expected k=v pairs separated by commas, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def _call_factory(factory, reference: str, cfg) -> nn.Module:
    kwargs = parse_model_args(cfg.model_args)
    params = inspect.signature(factory).parameters
    if "cfg" in params and "cfg" not in kwargs:
        kwargs["cfg"] = cfg
    try:
        model = factory(**kwargs)
    except TypeError as e:
        raise UsageError(
            f"--model {reference}: calling it with {kwargs or 'no arguments'}: {e}"
        ) from None
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"--model {reference} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def load_spec(reference: str, cfg) -> ModelSpec:
    """The spec of a user model (a ModelSpec it declares, or one made for its factory)."""
    obj = load_object(reference, "--model")
    if isinstance(obj, ModelSpec):
        return obj
    if not callable(obj):
        raise UsageError(f"--model {reference}: {type(obj).__name__} is not a factory or ModelSpec")
    shape = parse_shape(cfg.input_shape) if cfg.input_shape else None
    unit_class = cfg.fsdp_unit_class
    return ModelSpec(
        name=reference,
        build=lambda c: _call_factory(obj, reference, c),
        task="classify" if shape else "lm",
        input_shape=shape,
        datasets=ALL_DATASETS,
        default_dataset="synthetic",
        units=lambda model: infer_units(model, unit_class),
        num_classes=cfg.num_classes if shape else None,
        real_buffers=True,
    )


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise UsageError(f"--input-shape: expected sizes like 1,28,28, got {text!r}")
    return shape
