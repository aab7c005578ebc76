"""A benchmark sweep: strategies x world sizes x models x precisions x reshard settings x repeats.

A sweep file (TOML) names the axes, the ``train`` keys every run shares, keys per model, and
variants (named sets of train keys, e.g. FSDP2 with another unit policy)::

    [sweep]
    strategies = ["ddp", "fsdp1", "fsdp2", "hsdp"]   # built-in or [variants.NAME]
    world_sizes = [1, 2, 4]
    models = ["cnn", "gpt"]
    precisions = ["fp32"]          # default ["fp32"]
    reshard = ["true"]             # --reshard-after-forward values, default ["true"]
    repeat = 1                     # runs of each combination (for the spread)

    [train]                        # any ``fsdp2lab train`` key, for every run
    dataset = "synthetic"
    max_steps = 50

    [models.gpt]                   # keys for one model only
    d_model = 256

    [models.cnn-fmnist]            # a model of its own: another model's keys, its own axes
    model = "cnn"
    dataset = "fashion-mnist"
    strategies = ["compute-only", "fsdp2"]   # narrows the sweep's axes for this model (flags win)
    world_sizes = [2]
    repeat = 1                     # fewer repeats for this model

    [variants.fsdp2-auto]          # a strategy of its own in plots and tables
    strategy = "fsdp2"
    fsdp_units = "auto"

    [variants.compute-only-b128]   # side_by_side: world-size copies of a one-rank run at once
    strategy = "single"
    global_batch_size = 128
    side_by_side = true

Built-in strategies: single, ddp, fsdp1, fsdp2, hsdp (fsdp2 with ``dp_replicate = 2``) and
compute-only (``single`` side by side: on N ranks, N independent one-rank runs of 1/N of the
global batch each at the same time, no communication: the ceiling data parallelism aims at).
Combinations that cannot run (single on 2 ranks, hsdp on 1) are left out and listed. A file that
names code (``loss = "file.py:fn"``, a ``[models.X]`` ``model = "file.py:build"``, a model on the
``models`` axis whose name is code) is refused unless ``fsdp2lab bench --allow-code``; one that
names an output path outside the working directory (``profile = "../x"``), unless
``--allow-paths``.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp2lab import tomlio
from fsdp2lab.config import (
    CODE_KEYS,
    PRECISIONS,
    TrainConfig,
    check_consent,
    check_output_paths,
    check_reference_consent,
    is_reference,
    load_toml,
    read_toml_file,
    validate_basic,
)
from fsdp2lab.errors import UsageError

BUILTIN_VARIANTS: dict[str, dict[str, Any]] = {
    "single": {"strategy": "single"},
    "ddp": {"strategy": "ddp"},
    "fsdp1": {"strategy": "fsdp1"},
    "fsdp2": {"strategy": "fsdp2"},
    "hsdp": {"strategy": "fsdp2", "dp_replicate": 2},
    "compute-only": {"strategy": "single", "side_by_side": True},
}
# Keys of a [models.X] / [variants.X] table that are not train keys.
_MODEL_KEYS = ("model", "strategies", "world_sizes", "repeat")
_VARIANT_KEYS = ("side_by_side",)
# Keys the sweep sets itself for every run, and keys whose files every run would share.
_SWEEP_OWNED = ("model", "mixed_precision", "reshard_after_forward", "nproc_per_node")
_SHARED_FILES = (
    "metrics_file",
    "ckpt_dir",
    "save_model",
    "save_hf",
    "tensorboard",
    "memory_snapshot",
)
_RUN_DEFAULTS = {"progress": "off", "log_every_steps": 5}
_AXES = {
    "strategies": str,
    "world_sizes": int,
    "models": str,
    "precisions": str,
    "reshard": str,
}


@dataclass
class Sweep:
    strategies: list[str] = field(default_factory=lambda: ["ddp", "fsdp1", "fsdp2"])
    world_sizes: list[int] = field(default_factory=lambda: [1, 2])
    models: list[str] = field(default_factory=lambda: ["cnn"])
    precisions: list[str] = field(default_factory=lambda: ["fp32"])
    reshard: list[str] = field(default_factory=lambda: ["true"])
    repeat: int = 1
    train: dict[str, Any] = field(default_factory=dict)
    model_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    # [models.X]'s own: the model it is (``model``), and its narrowed axes.
    model_axes: dict[str, dict[str, Any]] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSpec:
    """One run of the sweep: its folder name and the train keys it is launched with."""

    run_id: str
    strategy: str  # the variant name: a line in the plots
    world_size: int
    model: str  # the sweep's model name (a [models.X] name can stand for another model)
    precision: str
    reshard: str
    repeat: int
    values: dict[str, Any]
    copies: int = 1  # side by side: this many one-rank runs at once, ``values`` each


def _where(path: str | None, section: str) -> str:
    return f"sweep file {path}: [{section}]" if path else f"bench: {section}"


def _check_list(value: Any, kind: type, where: str, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where} {key} must be a non-empty list, got {value!r}")
    for item in value:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise UsageError(f"{where} {key} must hold {kind.__name__} values, got {item!r}")
    return list(value)


def check_train_keys(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate ``fsdp2lab train`` keys exactly as a ``--config`` file's are."""
    if not values:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys.toml"
        try:
            path.write_text(to_toml(values), encoding="utf-8")
            checked = load_toml(str(path))
        except UsageError as e:
            raise UsageError(f"{where}: {e}".replace(f": config file {path}:", ":")) from None
    for key in _SWEEP_OWNED:
        if key in checked:
            raise UsageError(f"{where}: {key} is set by the sweep's axes; remove it")
    for key in _SHARED_FILES:
        if key in checked:
            raise UsageError(f"{where}: {key} would be one file for every run of the sweep")
    return checked


def to_toml(values: dict[str, Any]) -> str:
    """Flat ``key = value`` TOML of scalars (what ``load_toml`` reads back)."""
    try:
        return tomlio.dumps(values)
    except TypeError as e:
        raise UsageError(str(e)) from None


def load_sweep(path: str | None) -> Sweep:
    """Read a sweep file (or the defaults when ``path`` is None); any mistake is a UsageError.
    Code it names (``loss = "file.py:fn"``) is refused unless the command line allows it
    (:mod:`fsdp2lab.consent`), and so are output paths outside the working directory."""
    sweep = Sweep()
    if path is None:
        return sweep
    data = read_toml_file(path, "sweep file")
    known = {"sweep", "train", "models", "variants"}
    for key in data:
        if key not in known:
            raise UsageError(
                f"sweep file {path}: unknown table [{key}] (known: {', '.join(sorted(known))})"
            )
    _check_consent(data, path)
    axes = data.get("sweep", {})
    for key, value in axes.items():
        if key == "repeat":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(
                    f"{_where(path, 'sweep')} repeat must be an integer >= 1, got {value!r}"
                )
            sweep.repeat = value
        elif key in _AXES:
            setattr(sweep, key, _check_list(value, _AXES[key], _where(path, "sweep"), key))
        else:
            raise UsageError(
                f"{_where(path, 'sweep')} unknown key {key!r} "
                f"(known: {', '.join([*_AXES, 'repeat'])})"
            )
    sweep.train = check_train_keys(data.get("train", {}), _where(path, "train"))
    for section in ("models", "variants"):
        table = data.get(section, {})
        for name, values in table.items():
            if not isinstance(values, dict):
                raise UsageError(f"sweep file {path}: [{section}.{name}] must be a table")
            where = _where(path, f"{section}.{name}")
            if section == "variants":
                own = {k: values.pop(k) for k in _VARIANT_KEYS if k in values}
                if not isinstance(own.get("side_by_side", False), bool):
                    raise UsageError(f"{where} side_by_side must be true or false")
                sweep.variants[name] = {
                    "strategy": "fsdp2",
                    **check_train_keys(values, where),
                    **own,
                }
            else:
                sweep.model_axes[name] = _model_axes(values, where)
                sweep.model_keys[name] = check_train_keys(values, where)
    return sweep


def _check_consent(data: dict[str, Any], path: str) -> None:
    """Before anything is imported: code the file names needs consent, be it a table's key or a
    model the ``models`` axis names (a [models.X] table without ``model`` is the model X); an
    output path outside the working directory too."""
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    axis = data.get("sweep", {}).get("models") if isinstance(data.get("sweep"), dict) else None
    for name in axis if isinstance(axis, list) else []:
        table = models.get(name)
        if isinstance(name, str) and not (isinstance(table, dict) and "model" in table):
            check_reference_consent("model", name, f"{_where(path, 'sweep')} models")
    tables = {"train": data.get("train")}
    for section in ("models", "variants"):
        if isinstance(data.get(section), dict):
            tables.update({f"{section}.{n}": v for n, v in data[section].items()})
    for name, values in tables.items():
        if not isinstance(values, dict):
            continue
        if name.startswith("models.") and "model" not in values:  # the table's name is its model
            model = name.removeprefix("models.")
            check_reference_consent("model", model, f"{_where(path, name)} name")
        check_consent(values, _where(path, name))
        check_output_paths(values, _where(path, name), typed_as="bench ... -- ")


def _model_axes(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Pop a [models.X] table's own keys: ``model`` (a string) and its narrowed axes."""
    axes = {k: values.pop(k) for k in _MODEL_KEYS if k in values}
    if not isinstance(axes.get("model", ""), str):
        raise UsageError(f"{where} model must be a model name, got {axes['model']!r}")
    for key in ("strategies", "world_sizes"):
        if key in axes:
            axes[key] = _check_list(axes[key], _AXES[key], where, key)
    repeat = axes.get("repeat", 1)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise UsageError(f"{where} repeat must be an integer >= 1, got {repeat!r}")
    return axes


def override(sweep: Sweep, **axes: Any) -> Sweep:
    """Apply axes given as flags (None: keep the file's); a flag also replaces what a
    [models.X] table narrowed for its model."""
    changes = {k: v for k, v in axes.items() if v is not None}
    model_axes = {
        name: {k: v for k, v in own.items() if k not in changes}
        for name, own in sweep.model_axes.items()
    }
    return dataclasses.replace(sweep, **changes, model_axes=model_axes)


def validate(sweep: Sweep) -> None:
    from fsdp2lab.models import MODELS

    variants = {**BUILTIN_VARIANTS, **sweep.variants}
    for name in sweep.strategies:
        if name not in variants:
            raise UsageError(
                f"bench: unknown strategy {name!r}; choose built-in ones "
                f"({', '.join(BUILTIN_VARIANTS)}) or define [variants.{name}] in the sweep file"
            )
    for name in sweep.models:
        if name not in MODELS and name not in sweep.model_axes:
            raise UsageError(
                f"bench: unknown model {name!r}; choose from {', '.join(MODELS)} or define "
                f'[models.{name}] with model = "..." in the sweep file'
            )
    for name, axes in sweep.model_axes.items():
        base = axes.get("model", name)
        if base not in MODELS and not is_reference("model", base):
            raise UsageError(
                f"bench: [models.{name}] is no model: set model = one of {', '.join(MODELS)}"
            )
        for strategy in axes.get("strategies", []):
            if strategy not in variants:
                raise UsageError(f"bench: [models.{name}] strategies: unknown {strategy!r}")
    _check_references(sweep)
    for p in sweep.precisions:
        if p not in PRECISIONS:
            raise UsageError(f"bench: unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    for ws in sweep.world_sizes:
        if ws < 1:
            raise UsageError(f"bench: world sizes must be >= 1, got {ws}")
    for r in sweep.reshard:
        TrainConfig(reshard_after_forward=r).reshard_value()


def _check_references(sweep: Sweep) -> None:
    """Code a sweep names (``model``, ``loss``, ``dataset``) is the user's own, or the sweep
    stops."""
    from fsdp2lab.models.user import load_object

    tables = {"[train]": sweep.train}
    tables.update(
        {
            f"[models.{n}]": {**v, "model": sweep.model_axes.get(n, {}).get("model", n)}
            for n, v in sweep.model_keys.items()
        }
    )
    tables.update({f"[variants.{n}]": v for n, v in sweep.variants.items()})
    for table, values in tables.items():
        for key in CODE_KEYS:
            if isinstance(values.get(key), str) and is_reference(key, values[key]):
                load_object(values[key], f"bench: {table} {key}", key)


def plan(sweep: Sweep) -> tuple[list[RunSpec], list[str]]:
    """Every runnable combination (in a stable order), and why the others were left out."""
    validate(sweep)
    variants = {**BUILTIN_VARIANTS, **sweep.variants}
    combos: list[tuple[str, dict[str, Any], int, tuple]] = []
    repeats: dict[str, int] = {}
    skipped: list[str] = []
    for model in sweep.models:
        axes = sweep.model_axes.get(model, {})
        for precision in sweep.precisions:
            for reshard in sweep.reshard:
                for name in axes.get("strategies", sweep.strategies):
                    for ws in axes.get("world_sizes", sweep.world_sizes):
                        values = {
                            **_RUN_DEFAULTS,
                            **sweep.train,
                            **sweep.model_keys.get(model, {}),
                            **variants[name],
                            "model": axes.get("model", model),
                            "mixed_precision": precision,
                            "reshard_after_forward": reshard,
                        }
                        base = f"{model}-{name}-ws{ws}-{precision}" + (
                            f"-reshard{reshard}" if len(sweep.reshard) > 1 else ""
                        )
                        values, copies, reason = _side_by_side(values, ws)
                        reason = reason or _why_not(values, ws // copies)
                        if reason:
                            skipped.append(f"{base}: {reason}")
                        else:
                            combos.append(
                                (base, values, copies, (name, ws, model, precision, reshard))
                            )
                            repeats[base] = min(sweep.repeat, axes.get("repeat", sweep.repeat))
    # Repeats outermost: load that comes and goes on a shared machine falls on every combination.
    runs = [
        RunSpec(base + (f"-r{rep}" if sweep.repeat > 1 else ""), *axes, rep, values, copies)
        for rep in range(1, sweep.repeat + 1)
        for base, values, copies, axes in combos
        if rep <= repeats[base]
    ]
    if not runs:
        raise UsageError("bench: no combination of the sweep can run:\n  " + "\n  ".join(skipped))
    return runs, skipped


def _side_by_side(values: dict[str, Any], world_size: int) -> tuple[dict, int, str | None]:
    """A side-by-side variant on N ranks: N one-rank runs of 1/N of the global batch each."""
    if not values.pop("side_by_side", False):
        return values, 1, None
    from fsdp2lab.plan import resolve

    as_dp = TrainConfig(**{**values, "strategy": "ddp", "nproc_per_node": None})
    try:
        validate_basic(as_dp)
        per_rank = resolve(as_dp, world_size).global_batch // world_size
    except UsageError as e:
        return values, 1, str(e)
    values = {k: v for k, v in values.items() if k != "batch_size"}
    return {**values, "global_batch_size": per_rank}, world_size, None


def _why_not(values: dict[str, Any], world_size: int) -> str | None:
    """The reason a run cannot start on ``world_size`` ranks (the train command's own checks)."""
    from fsdp2lab.plan import resolve

    cfg = TrainConfig(**values)
    try:
        validate_basic(cfg)
        resolve(cfg, world_size)
    except UsageError as e:
        return str(e)
    return None
