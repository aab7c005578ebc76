"""What a config or sweep file may make fsdp2lab do without consent on the command line: import no
code (a sweep's model axis, a prefix on a key that takes none), and write only inside the working
directory. With consent, the wall still judges a module before it is imported."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import cli_env, run_cli
from fsdp2lab import cli
from fsdp2lab.bench import runner, sweep
from fsdp2lab.config import TrainConfig, add_train_arguments, config_from_args
from fsdp2lab.errors import UsageError
from fsdp2lab.plan import resolve

NEEDS_ALLOW_CODE = "names code, which runs only with --allow-code"


def _user_code(folder: Path, name: str) -> Path:
    """A file of code that leaves ``IMPORTED`` beside it when imported: a model and a loss."""
    file = folder / name
    file.write_text(
        textwrap.dedent(f"""
            import pathlib

            import torch.nn as nn

            pathlib.Path({str(folder / "IMPORTED")!r}).write_text("imported")


            def build():
                return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))


            def fn(output, target):
                return output.float().mean()
        """)
    )
    return folder / "IMPORTED"


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The working directory: ``tmp_path/work`` (``tmp_path`` holds what is outside it)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _config(path: Path, text: str, *flags: str) -> TrainConfig:
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(path), *flags]))


_SWEEP = """
[sweep]
models = ["evil.py:build"]
strategies = ["single"]
world_sizes = [1]

[train]
dataset = "synthetic"
max_steps = 1

[models."evil.py:build"]
"""


def test_bench_dry_run_imports_no_model_a_sweeps_axis_names(here, capsys):
    imported = _user_code(here, "evil.py")
    path = here / "s.toml"
    path.write_text(_SWEEP)
    assert cli.main(["bench", "--sweep", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"fsdp2lab: error: sweep file {path}: [sweep] models 'evil.py:build' {NEEDS_ALLOW_CODE} "
        "(give it only for a file you trust as a script you run)"
    ], err
    assert not imported.exists()
    # With consent the model is imported and planned.
    assert cli.main(["bench", "--sweep", str(path), "--dry-run", "--allow-code"]) == 0
    assert imported.exists()
    assert "evil.py:build-single-ws1-fp32" in capsys.readouterr().out


def test_a_sweep_table_named_as_code_needs_consent(here):
    """A [models.X] table without ``model`` is the model X: its name is code too."""
    imported = _user_code(here, "evil.py")
    path = here / "s.toml"
    path.write_text(_SWEEP.replace('models = ["evil.py:build"]', 'models = ["mlp"]'))
    with pytest.raises(UsageError, match=r"\[models.evil.py:build\] name .*" + NEEDS_ALLOW_CODE):
        sweep.load_sweep(str(path))
    assert not imported.exists()


@pytest.mark.parametrize("prefix", ["hf:", "tokens:"])
def test_a_prefix_exempts_no_loss(here, prefix):
    """``hf:``/``tokens:`` mean something for model and dataset only: a loss with one is code."""
    imported = _user_code(here, f"{prefix}evil.py")
    text = f'model = "gpt"\ndataset = "synthetic"\nloss = "{prefix}evil.py:fn"\n'
    path = here / "run.toml"
    with pytest.raises(UsageError, match=f"loss '{prefix}evil.py:fn' {NEEDS_ALLOW_CODE}"):
        _config(path, text)
    assert not imported.exists()
    plan = resolve(_config(path, text, "--allow-code"), 1)  # judged as code, and run
    assert imported.exists() and plan.loss.__name__ == "fn"


def test_a_prefix_exempts_no_loss_in_a_sweep(here):
    imported = _user_code(here, "tokens:evil.py")
    path = here / "s.toml"
    path.write_text(
        '[sweep]\nmodels = ["mlp"]\nstrategies = ["single"]\nworld_sizes = [1]\n'
        '[train]\nloss = "tokens:evil.py:fn"\n'
    )
    with pytest.raises(
        UsageError, match=r"\[train\]: loss 'tokens:evil.py:fn' " + NEEDS_ALLOW_CODE
    ):
        sweep.load_sweep(str(path))
    assert not imported.exists()


@pytest.mark.parametrize(
    "reference, why",
    [
        ("pip.__main__:x", "an installed library"),
        ("fsdp2lab.runtime.local_launcher:launch", "fsdp2lab itself"),
    ],
)
def test_the_wall_judges_a_library_module_before_it_is_imported(reference, why):
    """Typed (so consented): in a fresh interpreter the module is refused, one line, exit code 2,
    and it is not in ``sys.modules``."""
    module = reference.partition(":")[0]
    script = textwrap.dedent(f"""
        import sys
        from fsdp2lab.cli import main

        code = main(["plan", "--model", {reference!r}, "--world-size", "1"])
        print(code, {module!r} in sys.modules)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"fsdp2lab: error: --model '{reference}' is refused: {module} is in {why} "
        f"({_place(module)}): not imported; fsdp2lab calls only nn.Module classes, ModelSpecs and "
        "code defined in your own files or packages"
    ], proc.stderr


def _place(module: str) -> str:
    """Where the top-level package of ``module`` lives (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec(module.partition(".")[0]).submodule_search_locations[0]


def _outside_link(here: Path) -> str:
    outside = here.parent / "outside"
    outside.mkdir()
    (here / "link").symlink_to(outside, target_is_directory=True)
    return "link/metrics.jsonl"


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("save_model", "../victim.txt", "has a '..' component"),
        ("metrics_file", "../x", "has a '..' component"),
        ("ckpt_dir", "/scratch/ck", "is an absolute path"),
        ("metrics_file", "runs/../../x", "has a '..' component"),
        ("metrics_file", _outside_link, "leads out of the working directory through a symlink"),
    ],
)
def test_an_output_path_from_a_file_stays_in_the_working_directory(here, key, value, why):
    value = value(here) if callable(value) else value
    path = here / "run.toml"
    text = f'model = "mlp"\n{key} = "{value}"\n'
    flag = "--" + key.replace("_", "-")
    with pytest.raises(UsageError) as refused:
        _config(path, text)
    assert str(refused.value) == (
        f"config file {path}: {key} {value!r} {why}; a file names output paths only inside the "
        f"working directory: give it on the command line ({flag} {value}) or add --allow-paths"
    )
    assert getattr(_config(path, text, "--allow-paths"), key) == value
    assert getattr(_config(path, 'model = "mlp"\n', flag, value), key) == value  # typed: yours


def test_a_default_name_made_from_a_files_key_stays_in_the_working_directory(here):
    """``--save-model`` typed without a name takes the model's: from the file, it is checked."""
    path = here / "run.toml"
    with pytest.raises(UsageError, match=r"save_model '\.\./\.\./victim\.pt' has a '\.\.'"):
        _config(path, 'model = "hf:../../victim"\n', "--save-model")


def test_output_paths_inside_the_working_directory_need_no_consent(here):
    (here / "sub").mkdir()
    (here / "inner").symlink_to(here / "sub", target_is_directory=True)
    text = 'model = "mlp"\nsave_model = "out/m.pt"\nmetrics_file = "inner/m.jsonl"\n'
    cfg = _config(here / "run.toml", text)
    assert (cfg.save_model, cfg.metrics_file) == ("out/m.pt", "inner/m.jsonl")


def test_a_sweeps_output_path_needs_allow_paths(here):
    from fsdp2lab import consent

    path = here / "s.toml"
    path.write_text(
        '[sweep]\nmodels = ["mlp"]\nstrategies = ["single"]\nworld_sizes = [1]\n'
        '[train]\nprofile = "../p"\n'
    )
    with pytest.raises(UsageError, match=r"\[train\]: profile '\.\./p' has a '\.\.' component"):
        sweep.load_sweep(str(path))
    with consent.granted(allow_code=False, allow_paths=True):
        assert sweep.load_sweep(str(path)).train["profile"] == "../p"
    run = sweep.RunSpec("r", "single", 1, "mlp", "fp32", "true", 1, {"profile": "../p"})
    assert "--allow-paths" in runner.command(run, here, "local", allow_paths=True)
    assert "--allow-paths" not in runner.command(run, here, "local")


def test_train_refuses_a_files_output_path_before_any_worker(here):
    """The issue's case through the CLI: one line, exit code 2, the file outside untouched."""
    victim = here.parent / "victim.txt"
    victim.write_text("precious")
    config = here / "run.toml"
    config.write_text('save_model = "../victim.txt"\n')
    flags = ["--model", "mlp", "--dataset", "synthetic", "--max-steps", "1"]
    proc = run_cli(["train", "--config", str(config), *flags, "--nproc-per-node", "2"], cwd=here)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"fsdp2lab: error: config file {config}: save_model '../victim.txt' has a '..' component; "
        "a file names output paths only inside the working directory: give it on the command "
        "line (--save-model ../victim.txt) or add --allow-paths"
    ], proc.stderr
    assert proc.stdout == ""
    assert victim.read_text() == "precious"
