"""Your own model: ``--model pkg.module:NAME`` or ``--model path/to/file.py:NAME``.

``NAME`` is either a :class:`~fsdp2lab.models.spec.ModelSpec` (the model says everything about
itself, as the built-in models do: units, TP plan, pipeline) or a factory that returns an
``nn.Module``; a factory is called with the ``--model-args 'k=v,...'`` keywords, and its model gets
its sharding units inferred (the most repeated block class, or ``--fsdp-unit-class``). Its task
follows the data: ``--input-shape C,H,W`` makes it a classifier of ``--num-classes`` classes;
otherwise it is a language model over ``--vocab-size`` tokens of ``--seq-len``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import re
import site
import sys
import sysconfig
from importlib import import_module
from pathlib import Path

import torch.nn as nn

from fsdp2lab import consent
from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec, infer_units

ALL_DATASETS = ("mnist", "fashion-mnist", "cifar10", "synthetic", "text", "tokens")


class RefusedReference(UsageError):
    """A reference to code that is not the user's own (``os:system``): never called."""


_ALLOWED = (
    "fsdp2lab calls only nn.Module classes, ModelSpecs and code defined in your own files or "
    "packages"
)


def _library_paths() -> list[Path]:
    """Where Python's standard library, installed packages and fsdp2lab itself live."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages())
    paths.add(str(Path(__file__).resolve().parents[1]))  # fsdp2lab
    return [Path(p).resolve() for p in paths if p]


_PYTHON_TREE = re.compile(r"python3(\.\d+)?t?")


def _library_of(path: str | Path) -> str | None:
    """What ``path`` belongs to when it is not the user's own code, else None."""
    if str(path).startswith("<"):  # <frozen os>, <string>: no file of yours
        return "no file of yours"
    path = Path(path).resolve()
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return "an installed library"
    for root in _library_paths():
        if path.is_relative_to(root):
            return "fsdp2lab itself" if root.name == "fsdp2lab" else "Python's standard library"
    parts = path.parts
    if any(
        parent.startswith("lib") and _PYTHON_TREE.fullmatch(part)
        for parent, part in zip(parts, parts[1:], strict=False)
    ):
        return "a Python installation (a lib/python3.* tree)"
    return None


def _refuse(what: str, reference: str, why: str) -> RefusedReference:
    return RefusedReference(f"{what} {reference!r} is refused: {why}; {_ALLOWED}")


def _check_module(where: str, what: str, reference: str) -> None:
    """Before any import: the file, or the module's top-level package (found without importing
    anything), is not the standard library's, an installed library's or fsdp2lab's. A module
    already imported runs nothing when imported again: what it holds is judged by what it is."""
    if where.endswith(".py"):
        if library := _library_of(where):
            raise _refuse(what, reference, f"{where} is in {library}")
        return
    top = where.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise _refuse(what, reference, f"{top} is part of Python's standard library")
    if where in sys.modules:
        return
    try:
        found = importlib.util.find_spec(top)  # a top-level name: no parent package to import
    except (ImportError, ValueError):
        found = None
    if found is None:
        return  # nothing to import: import_module says so
    places = [*(found.submodule_search_locations or [])]
    if found.origin and found.has_location:
        places.append(found.origin)
    for place in places:
        if library := _library_of(place):
            raise _refuse(what, reference, f"{where} is in {library} ({place}): not imported")


def _defined_in(obj) -> str | None:
    """The file that defines ``obj`` (a function's code, a class's or an instance's class)."""
    with contextlib.suppress(ValueError):  # a decorated function: where it itself is defined
        obj = inspect.unwrap(obj)
    if inspect.isfunction(obj):
        return obj.__code__.co_filename
    cls = obj if isinstance(obj, type) else type(obj)
    try:
        return inspect.getfile(cls)
    except (TypeError, OSError):  # a built-in (os.system, exec) or a class without a file
        return None


def _check_callable(obj, what: str, reference: str) -> None:
    """Call nothing but models (nn.Module classes, ModelSpecs) and the user's own code."""
    if isinstance(obj, (ModelSpec, nn.Module)) or not callable(obj):
        return  # data, or a module to run: the caller checks what it needs
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return
    file = _defined_in(obj)
    if file is None:
        raise _refuse(what, reference, f"{_name(obj)} is built into Python")
    if library := _library_of(file):
        raise _refuse(what, reference, f"{_name(obj)} is defined in {library} ({file})")
    module = getattr(obj, "__module__", None) or type(obj).__module__
    if isinstance(module, str) and module.partition(".")[0] in sys.stdlib_module_names:
        raise _refuse(what, reference, f"{_name(obj)} is part of Python's standard library")


def _name(obj) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def load_object(reference: str, what: str, key: str):
    """The object ``reference`` (``pkg.module:attr`` or ``path/file.py:attr``), given as ``key``
    (``model``, ``dataset``, ``loss``), names: a model (an nn.Module class, a ModelSpec), a value,
    or code defined in the user's own file or package (never the standard library's, an installed
    library's or fsdp2lab's: ``os:system``). Nothing is imported without consent
    (:mod:`fsdp2lab.consent`)."""
    consent.require_code(key, reference, what)
    where, _, attr = reference.rpartition(":")
    if not where or not attr:
        raise UsageError(f"{what} {reference!r}: expected MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py") and not Path(where).is_file():
        raise UsageError(f"{what} {reference!r}: no such file {where}")
    _check_module(where, what, reference)
    try:
        module = _import_file(Path(where)) if where.endswith(".py") else import_module(where)
    except Exception as e:  # the user's code: any error it raises on import
        raise UsageError(
            f"{what} {reference!r}: cannot import {where}: {type(e).__name__}: {e}"
        ) from None
    if not hasattr(module, attr):
        raise UsageError(f"{what} {reference!r}: {where} has no {attr!r}")
    obj = getattr(module, attr)
    _check_callable(obj, what, reference)
    return obj


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
    obj = load_object(reference, "--model", "model")
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
