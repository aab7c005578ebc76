"""A config that names code is code: it runs only with ``--allow-code``; even then references into
the standard library, builtins or installed libraries (``os:system``) are refused before anything
is called; models and your own code run."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import pytest
import torch.nn as nn

from conftest import run_cli
from fsdp2lab import cli, consent
from fsdp2lab.bench import runner, sweep
from fsdp2lab.config import TrainConfig, add_train_arguments, config_from_args
from fsdp2lab.data.loader import choose
from fsdp2lab.errors import UsageError
from fsdp2lab.models import get_spec, user
from fsdp2lab.models.spec import ModelSpec
from fsdp2lab.models.user import RefusedReference, load_object
from fsdp2lab.plan import resolve

MINE = """
import functools
import os
from importlib import import_module
from os import popen, system
from runpy import run_path
from subprocess import run as launch

import torch.nn as nn
from torch.hub import load as hub_load


def build(d=4):
    return nn.Linear(d, d)


@functools.lru_cache
def cached():
    return nn.Linear(2, 2)


class Block(nn.Module):
    pass


ce = nn.CrossEntropyLoss()
partial_build = functools.partial(build, 3)
"""


@pytest.fixture
def mine(tmp_path, monkeypatch):
    """A user's own file, importable as ``mine`` (cwd) and as ``mine.py``."""
    (tmp_path / "mine.py").write_text(MINE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def code_allowed():
    """``--allow-code``, as a command line gives it: the consent gate opens, the wall stays."""
    with consent.granted():
        yield


@pytest.mark.parametrize(
    "reference, why",
    [
        ("os:system", "os is part of Python's standard library"),
        ("subprocess:run", "subprocess is part of Python's standard library"),
        ("builtins:exec", "builtins is part of Python's standard library"),
        ("torch.hub:load", "torch.hub.load is defined in an installed library"),
        ("fsdp2lab.data.user:load", "defined in fsdp2lab itself"),
        ("mine.py:system", "posix.system is built into Python"),
        ("mine.py:launch", "subprocess.run is defined in Python's standard library"),
        ("mine.py:hub_load", "torch.hub.load is defined in an installed library"),
        ("mine:partial_build", "functools.partial is defined in Python's standard library"),
        ("mine.py:popen", r"os.popen is defined in no file of yours \(<frozen os>\)"),
        ("runpy:run_path", "runpy is part of Python's standard library"),
        ("importlib:import_module", "importlib is part of Python's standard library"),
        ("mine.py:run_path", r"runpy.run_path is defined in no file of yours \(<frozen runpy>\)"),
        ("mine.py:import_module", "importlib.import_module is defined in Python's standard"),
    ],
)
def test_code_not_your_own_is_refused(mine, code_allowed, reference, why):
    with pytest.raises(RefusedReference, match=f"--model '{reference}' is refused: .*{why}"):
        load_object(reference, "--model", "model")


@pytest.mark.parametrize(
    "reference, kind",
    [
        ("mine.py:build", "function"),
        ("mine:build", "function"),
        ("mine.py:cached", "_lru_cache_wrapper"),  # decorated: the function is yours
        ("mine.py:Block", "type"),
        ("torch.nn:Linear", "type"),  # an nn.Module class, from anywhere
        ("mine.py:ce", "CrossEntropyLoss"),  # a module to call (a --loss)
        ("fsdp2lab.models.gpt:SPEC", "ModelSpec"),
    ],
)
def test_models_and_your_own_code_load(mine, code_allowed, reference, kind):
    assert type(load_object(reference, "--model", "model")).__name__ == kind


def test_a_models_spec_from_a_library_module_class(mine, code_allowed):
    spec = get_spec("torch.nn:Linear", TrainConfig(model="torch.nn:Linear", input_shape="8"))
    assert isinstance(spec, ModelSpec)
    built = spec.build(
        TrainConfig(model="torch.nn:Linear", model_args="in_features=8,out_features=3")
    )
    assert isinstance(built, nn.Linear)


def _python_tree(root: Path, parts: str = "usr/lib/python3.9") -> Path:
    """A Python installation other than this interpreter's (the system's): its subprocess.py."""
    import subprocess as real

    tree = root / parts
    tree.mkdir(parents=True)
    (tree / "subprocess.py").write_text(inspect.getsource(real))
    return tree / "subprocess.py"


@pytest.mark.parametrize("parts", ["usr/lib/python3.9", "opt/py/lib64/python3.13t"])
def test_a_python_tree_outside_this_interpreter_is_refused_unimported(tmp_path, code_allowed,
                                                                     parts):  # fmt: skip
    file = _python_tree(tmp_path, parts)
    file.write_text(f"open({str(tmp_path / 'imported')!r}, 'w')\n" + file.read_text())
    with pytest.raises(RefusedReference, match=r"is in a Python installation \(a lib/python3"):
        load_object(f"{file}:run", "--model", "model")
    assert not (tmp_path / "imported").exists()


def test_a_standard_library_function_is_refused_by_its_module_name(mine, code_allowed,
                                                                  monkeypatch):  # fmt: skip
    """The last wall: a Python laid out where no path rule sees it (the file checks pass)."""
    monkeypatch.setattr(user, "_library_of", lambda path: None)
    with pytest.raises(RefusedReference, match="subprocess.run is part of Python's standard"):
        load_object("mine.py:launch", "--model", "model")
    assert callable(load_object("mine.py:build", "--model", "model"))  # your own code still loads


def _config(path: Path, text: str, *flags: str) -> TrainConfig:
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(path), *flags]))


@pytest.mark.parametrize("key", ["model", "dataset", "loss"])
def test_a_config_naming_code_needs_allow_code(mine, key):
    path = mine / "run.toml"
    text = f'{key} = "mine.py:build"\n'
    with pytest.raises(
        UsageError,
        match=re.escape(f"config file {path}: {key} 'mine.py:build' names code, which runs only "
                        "with --allow-code"),
    ):  # fmt: skip
        _config(path, text)
    assert getattr(_config(path, text, "--allow-code"), key) == "mine.py:build"
    # Typed on the command line it is the user's own choice; a flag that replaces it wins.
    flag = f"--{key}"
    assert getattr(_config(path, "epochs = 1\n", flag, "mine.py:build"), key) == "mine.py:build"
    assert getattr(_config(path, text, flag, "mine.py:ce"), key) == "mine.py:ce"


def _probes(tmp_path: Path) -> dict[str, tuple[str, dict]]:
    """Each probe: a model reference, and the keywords that make it leave a file if called."""
    marker = str(tmp_path / "PWNED")
    (tmp_path / "script.py").write_text(f"open({marker!r}, 'w')\n")
    (tmp_path / "side_effect.py").write_text(f"open({marker!r}, 'w')\n")
    import os as real_os
    import subprocess as real_subprocess

    touch = {"args": ["touch", marker]}
    probes = {
        "python-tree": (f"{_python_tree(tmp_path)}:run", touch),
        "stdlib-subprocess.py": (f"{real_subprocess.__file__}:run", touch),
        "os.py:popen": (f"{real_os.__file__}:popen", {"cmd": f"touch {marker}"}),
        "frozen-re-export": ("mine.py:popen", {"cmd": f"touch {marker}"}),
        "runpy": ("runpy:run_path", {"path_name": str(tmp_path / "script.py")}),
        "importlib": ("importlib:import_module", {"name": "side_effect"}),
        "re-export": ("mine.py:launch", touch),
    }
    if Path("/usr/lib/python3").exists():  # the issue's probe: the system Python's own file
        for tree in sorted(Path("/usr/lib").glob("python3.*/subprocess.py")):
            probes["system-python"] = (f"{tree}:run", touch)
    return probes


def test_every_probe_runs_nothing_with_or_without_allow_code(mine):
    path = mine / "evil.toml"
    for name, (reference, kwargs) in _probes(mine).items():
        text = f"model = {json.dumps(reference)}\n[model_args]\n" + "".join(
            f"{k} = {json.dumps(v)}\n" for k, v in kwargs.items()
        )
        with pytest.raises(UsageError, match="names code, which runs only with --allow-code"):
            _config(path, text)
        cfg = _config(path, text, "--allow-code")
        with pytest.raises(RefusedReference, match=f"--model '{re.escape(reference)}' is refused"):
            resolve(cfg, 1)  # builds the model: the factory would be called here
        assert not (mine / "PWNED").exists(), name


def test_the_issues_probe_through_the_cli(tmp_path):
    """One line and exit code 2, with and without --allow-code; the command never runs."""
    config = tmp_path / "evil.toml"
    reference = f"{_python_tree(tmp_path)}:run"
    config.write_text(f'model = "{reference}"\n[model_args]\nargs = ["touch", "PWNED"]\n')
    proc = run_cli(["train", "--config", str(config), "--nproc-per-node", "1"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"fsdp2lab: error: config file {config}: model '{reference}' names code, which runs only "
        "with --allow-code (give it only for a file you trust as a script you run)"
    ], proc.stderr
    flags = ["train", "--config", str(config), "--allow-code", "--nproc-per-node", "1"]
    proc = run_cli(flags, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"fsdp2lab: error: --model '{reference}' is refused: {reference[:-4]} is in a Python "
        "installation (a lib/python3.* tree); fsdp2lab calls only nn.Module classes, ModelSpecs "
        "and code defined in your own files or packages"
    ], proc.stderr
    assert not (tmp_path / "PWNED").exists()


def test_dataset_reference_refused_before_workers_start(mine, code_allowed):
    cfg = TrainConfig(model="mlp", dataset="mine.py:launch")
    with pytest.raises(RefusedReference, match="--dataset 'mine.py:launch' is refused"):
        choose(cfg, get_spec("mlp", cfg))


_SWEEP = '[sweep]\nmodels = ["mlp"]\nstrategies = ["ddp"]\nworld_sizes = [1]\n'


def _sweep_file(tmp_path: Path, table: str, keys: str) -> Path:
    text = _SWEEP + f"{table}\n{keys}"
    if table == "[variants.mine]":
        text = text.replace('strategies = ["ddp"]', 'strategies = ["mine"]')
    if table == "[models.mine]":
        text = text.replace('models = ["mlp"]', 'models = ["mine"]')
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


_TABLES = [
    ("[train]", "loss"),
    ("[models.mlp]", "loss"),
    ("[variants.mine]", "dataset"),
    ("[models.mine]", "model"),
]


@pytest.mark.parametrize("table, key", _TABLES)
def test_a_sweep_file_naming_code_needs_allow_code(mine, table, key):
    path = _sweep_file(mine, table, f'{key} = "mine.py:launch"\n')
    where = f"sweep file {path}: {table}: {key} 'mine.py:launch' names code"
    with pytest.raises(UsageError, match=re.escape(where)):
        sweep.load_sweep(str(path))
    # With it, the second wall: code not your own is still refused, before any run.
    refused = f"bench: {table} {key} 'mine.py:launch' is refused: subprocess.run is defined in"
    with pytest.raises(UsageError, match=re.escape(refused)), consent.granted():
        sweep.plan(sweep.load_sweep(str(path)))


@pytest.mark.parametrize("table, key", _TABLES)
def test_sweep_file_naming_os_system_is_refused(tmp_path, code_allowed, table, key):
    path = _sweep_file(tmp_path, table, f'{key} = "os:system"\n')
    with pytest.raises(UsageError, match=re.escape(f"bench: {table} {key} 'os:system' is refused")):
        sweep.plan(sweep.load_sweep(str(path)))


@pytest.mark.parametrize(
    "flags, keys, on_the_run",
    [
        (["--allow-code"], 'loss = "mine.py:ce"\n', ["--allow-code"]),
        ([], "max_steps = 1\n", []),
        (["--allow-code"], "max_steps = 1\n", ["--allow-code"]),
        # typed: the user's own, on the run's command line too; nothing else is allowed there
        (["--", "--loss", "mine.py:ce"], "max_steps = 1\n", ["--loss", "mine.py:ce"]),
    ],
)
def test_bench_passes_on_only_the_consent_its_user_gave(mine, monkeypatch, flags, keys,
                                                        on_the_run):  # fmt: skip
    commands = []

    def run_sweep(runs, out, **kw):
        commands.extend(
            runner.command(run, out, "local", allow_code=kw["allow_code"]) for run in runs
        )
        return []

    monkeypatch.setattr(runner, "run_sweep", run_sweep)
    path = _sweep_file(mine, "[train]", keys)
    args = ["bench", "--sweep", str(path), "--out", str(mine / "out"), *flags]
    assert cli.main(args) == 0
    (command,) = commands
    given = [a for a in command if a in ("--allow-code", "--loss", "mine.py:ce")]
    assert given == on_the_run, command


@pytest.mark.slow  # the CLI's bench in a subprocess; the sweep check itself is tested above
def test_bench_dry_run_refuses_a_sweep_naming_code(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(_SWEEP + '[train]\ndataset = "subprocess:run"\n')
    proc = run_cli(["bench", "--sweep", str(path), "--dry-run"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        f"fsdp2lab: error: sweep file {path}: [train]: dataset 'subprocess:run' names code, which "
        "runs only with --allow-code"
    ), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = run_cli(["bench", "--sweep", str(path), "--dry-run", "--allow-code"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "fsdp2lab: error: bench: [train] dataset 'subprocess:run' is refused: subprocess is part"
    ), proc.stderr
