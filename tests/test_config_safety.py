"""A config that names code is code: references into the standard library, builtins or installed
libraries (``os:system``) are refused before anything is called; models and your own code run."""

from __future__ import annotations

import re

import pytest
import torch.nn as nn

from conftest import run_cli
from fsdp2lab.bench import sweep
from fsdp2lab.config import TrainConfig
from fsdp2lab.data.loader import choose
from fsdp2lab.errors import UsageError
from fsdp2lab.models import get_spec
from fsdp2lab.models.spec import ModelSpec
from fsdp2lab.models.user import RefusedReference, load_object

MINE = """
import functools
import os
from os import system
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
    ],
)
def test_code_not_your_own_is_refused(mine, reference, why):
    with pytest.raises(RefusedReference, match=f"--model '{reference}' is refused: .*{why}"):
        load_object(reference, "--model")


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
def test_models_and_your_own_code_load(mine, reference, kind):
    assert type(load_object(reference, "--model")).__name__ == kind


def test_a_models_spec_from_a_library_module_class(mine):
    spec = get_spec("torch.nn:Linear", TrainConfig(model="torch.nn:Linear", input_shape="8"))
    assert isinstance(spec, ModelSpec)
    built = spec.build(
        TrainConfig(model="torch.nn:Linear", model_args="in_features=8,out_features=3")
    )
    assert isinstance(built, nn.Linear)


def test_toml_config_naming_os_system_runs_nothing(tmp_path):
    """The issue's probe: the command must not run, and the refusal is one line with exit 2."""
    marker = tmp_path / "ran"
    config = tmp_path / "evil.toml"
    config.write_text(f'model = "os:system"\n[model_args]\ncommand = "touch {marker}"\n')
    proc = run_cli(["train", "--config", str(config), "--nproc-per-node", "1"], cwd=tmp_path)
    assert not marker.exists()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "fsdp2lab: error: --model 'os:system' is refused: os is part of Python's standard "
        "library; fsdp2lab calls only nn.Module classes, ModelSpecs and code defined in your own "
        "files or packages"
    ], proc.stderr


def test_dataset_reference_refused_before_workers_start(mine):
    cfg = TrainConfig(model="mlp", dataset="mine.py:launch")
    with pytest.raises(RefusedReference, match="--dataset 'mine.py:launch' is refused"):
        choose(cfg, get_spec("mlp", cfg))


@pytest.mark.parametrize("table", ["[train]", "[models.mlp]", "[variants.mine]"])
def test_sweep_file_naming_os_system_is_refused(tmp_path, table):
    keys = 'loss = "os:system"\n'
    if table == "[variants.mine]":
        keys += 'strategy = "ddp"\n'
    text = f'[sweep]\nmodels = ["mlp"]\nstrategies = ["ddp"]\nworld_sizes = [1]\n{table}\n{keys}'
    if table == "[variants.mine]":
        text = text.replace('strategies = ["ddp"]', 'strategies = ["mine"]')
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(f"bench: {table} loss 'os:system' is refused")):
        sweep.plan(sweep.load_sweep(str(path)))


@pytest.mark.slow  # the CLI's bench in a subprocess; the sweep check itself is tested above
def test_bench_dry_run_refuses_a_sweep_naming_os_system(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text('[sweep]\nmodels = ["mlp"]\nstrategies = ["ddp"]\nworld_sizes = [1]\n'
                    '[train]\ndataset = "subprocess:run"\n')  # fmt: skip
    proc = run_cli(["bench", "--sweep", str(path), "--dry-run"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "fsdp2lab: error: bench: [train] dataset 'subprocess:run' is refused: subprocess is part"
    ), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
