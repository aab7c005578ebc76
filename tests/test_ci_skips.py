"""Under CI=true a skip fails the stage (tests/conftest.py) unless its reason is one of
tests/skips.py's: no GPU where there is none, fewer GPUs than needed, a compat test's branch for
another torch version, an extra's package in a test or module of its stage in a run outside it.
Markers allow nothing else: a `gpu` or `compat` test skipping for another reason fails too. The
rules are tested on ``skips.allowed``, both ways; the slow cases run pytest on small test files
with this suite's conftest."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import skips
from conftest import cli_env, module_marks

CASES = """
import pytest
from skips import NO_GPU, fewer_gpus, other_torch

def test_slurm_missing():
    pytest.skip("Slurm packages missing")

@pytest.mark.skipif(True, reason="fashion-mnist missing")
def test_data_missing():
    pass

@pytest.mark.gpu
def test_gpu_test_skipping_for_slurm():
    pytest.skip("Slurm packages missing")

@pytest.mark.compat
def test_compat_test_skipping_in_its_own_words():
    pytest.skip("this torch has no such interface")

@pytest.mark.gpu
def test_as_many_gpus_as_needed():
    pytest.skip(fewer_gpus(2, 2))

@pytest.mark.gpu
@pytest.mark.skipif(True, reason=NO_GPU)
def test_no_gpu():
    pass

def test_fewer_gpus():
    pytest.skip(fewer_gpus(2, 1))

@pytest.mark.compat
def test_other_torch():
    pytest.skip(other_torch(">=99", "this torch has no such interface"))

@pytest.mark.compat
def test_other_torch_that_is_this_one():
    pytest.skip(other_torch(">=2.0", "this torch has no such interface"))

def test_other_torch_outside_compat():
    pytest.skip(other_torch(">=99", "this torch has no such interface"))
"""
FAILING = ["test_slurm_missing", "test_gpu_test_skipping_for_slurm",
           "test_compat_test_skipping_in_its_own_words", "test_as_many_gpus_as_needed",
           "test_other_torch_that_is_this_one", "test_other_torch_outside_compat"]  # fmt: skip
ALLOWED = ["needs 2 GPUs, 1 here",
           "the other torch version's branch: needs torch >=99: this torch has no such interface"]  # fmt: skip
HF_MODULE = """
import pytest

pytestmark = pytest.mark.hf
pytest.skip("could not import 'transformers': No module named 'transformers'", allow_module_level=True)
"""
DEFAULT_MODULE = """
import pytest

pytest.skip("could not import 'transformers': No module named 'transformers'", allow_module_level=True)
"""
TOKENIZERS_MODULE = """
import pytest

pytestmark = [pytest.mark.hf]
pytest.skip("could not import 'tokenizers': No module named 'tokenizers'", allow_module_level=True)
"""
HF_FUNCTION = """
import pytest

REASON = "could not import 'transformers': No module named 'transformers'"

@pytest.mark.gpu
@pytest.mark.hf
def test_of_the_hf_stage():
    pytest.skip(REASON)

@pytest.mark.gpu
def test_of_no_hf_stage():  # no stage would run it with transformers
    pytest.skip(REASON)
"""


def _pytest(folder: Path, ci: bool, *args: str) -> subprocess.CompletedProcess:
    env = cli_env({"CI": "true" if ci else ""})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", "-q", *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for helper in ("conftest.py", "skips.py"):
        shutil.copy(Path(__file__).with_name(helper), tmp_path / helper)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu\n    compat\n    hf\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_hf_module.py").write_text(HF_MODULE)
    (tmp_path / "test_hf_function.py").write_text(HF_FUNCTION)
    (tmp_path / "test_default_module.py").write_text(DEFAULT_MODULE)
    (tmp_path / "test_tokenizers_module.py").write_text(TOKENIZERS_MODULE)
    return tmp_path


@pytest.mark.slow  # pytest runs of their own: the slow stage keeps command 2 short
def test_under_ci_only_the_allowed_reasons_stay_skips(folder):
    local = _pytest(folder, False, "test_cases.py")
    assert local.returncode == 0 and "10 skipped" in local.stdout, local.stdout
    ci = _pytest(folder, True, "test_cases.py")
    assert ci.returncode == 1, ci.stdout
    # a skip in the call fails it; a skipif (at set-up) errors; NO_GPU where a GPU is, too
    gpu = torch.cuda.is_available()
    assert f"6 failed, {2 if gpu else 3} skipped, {2 if gpu else 1} error" in ci.stdout, ci.stdout
    for name in FAILING:
        assert f"FAILED test_cases.py::{name} - skipped under CI=true" in ci.stdout, ci.stdout
    assert "ERROR test_cases.py::test_data_missing - skipped under CI=true" in ci.stdout
    if not gpu:
        assert f": {skips.NO_GPU}\n" in ci.stdout
    assert "Slurm packages missing" in ci.stdout and "fashion-mnist missing" in ci.stdout
    for reason in ALLOWED:  # skipped, with their reasons printed
        assert f": {reason}\n" in ci.stdout and "SKIPPED [1] test_cases.py" in ci.stdout, reason


@pytest.mark.slow
def test_an_extra_missing_fails_only_in_its_own_stage(folder):
    """``importorskip``'s reason for transformers, at collection (a module) or in a test."""
    other_stage = _pytest(folder, True, "test_hf_module.py", "test_hf_function.py", "-m", "gpu")
    assert other_stage.returncode == 1, other_stage.stdout
    assert "1 failed, 2 skipped" in other_stage.stdout, other_stage.stdout
    assert (
        "FAILED test_hf_function.py::test_of_no_hf_stage - skipped under CI" in other_stage.stdout
    )
    for case, outcome in (("test_hf_module.py", "1 error"), ("test_hf_function.py", "2 failed")):
        hf_stage = _pytest(folder, True, case, "-m", "hf or gpu")
        assert hf_stage.returncode != 0 and f"{outcome} in" in hf_stage.stdout, hf_stage.stdout
        assert "skipped under CI=true" in hf_stage.stdout, hf_stage.stdout


@pytest.mark.slow
def test_a_collection_skip_is_judged_by_the_modules_own_markers(folder):
    """A default-suite module skipping at import (``importorskip``) fails in the default run; a
    module of the hf stage may, outside that stage; tokenizers (a dev package) never may."""
    run = _pytest(folder, True, "test_default_module.py", "test_hf_module.py", "-m", "not hf")
    assert run.returncode != 0 and "1 error" in run.stdout, run.stdout
    assert "ERROR test_default_module.py - skipped under CI=true" in run.stdout, run.stdout
    assert "SKIPPED [1] test_hf_module.py" in run.stdout, run.stdout
    run = _pytest(folder, True, "test_tokenizers_module.py", "-m", "not hf")
    assert run.returncode != 0 and "ERROR test_tokenizers_module.py" in run.stdout, run.stdout


def _in(*marks: str):
    return {"selected": lambda marker: False, "marks": set(marks)}


@pytest.mark.parametrize("cuda, ok", [(False, True), (True, False)])
def test_no_gpu_is_allowed_only_without_cuda(cuda, ok):
    assert skips.allowed(skips.NO_GPU, **_in("gpu"), cuda=cuda) is ok


@pytest.mark.parametrize(
    "needs, version, marks, ok",
    [
        (">=2.15", "2.8.0", ("compat",), True),  # the branch of a newer torch, on 2.8
        (">=2.15", "2.15.0+cu132", ("compat",), False),  # its own torch: the branch must run
        ("<2.9", "2.15.0", ("compat",), True),
        ("<2.9", "2.8.0+cpu", ("compat",), False),
        (">=2.15", "2.8.0", (), False),  # outside the compat stage
        ("no version", "2.8.0", ("compat",), False),  # not a version condition
    ],
)
def test_other_torch_needs_a_compat_test_and_a_version_it_is_not(needs, version, marks, ok):
    reason = skips.other_torch(needs, "this torch has no such interface")
    assert skips.allowed(reason, **_in(*marks), torch_version=version) is ok


def test_other_torch_in_free_words_is_refused():
    reason = "the other torch version's branch: this torch has no such interface"
    assert not skips.allowed(reason, **_in("compat"), torch_version="2.8.0")


@pytest.mark.parametrize(
    "package, marks, selected, ok",
    [
        ("transformers", ("hf",), False, True),  # an hf test outside the hf stage
        ("transformers", ("hf",), True, False),  # in the hf stage: it must be installed
        ("transformers", (), False, False),  # a default-suite test or module
        ("tokenizers", ("hf",), False, False),  # the dev extra's: always installed
        ("tokenizers", (), False, False),
        ("slurm", ("hf",), False, False),  # no extra's package
    ],
)
def test_an_extras_package_may_be_missing_only_outside_its_stage(package, marks, selected, ok):
    reason = f"could not import '{package}': No module named '{package}'"
    allowed = skips.allowed(reason, lambda marker: selected, set(marks))
    assert allowed is ok


@pytest.mark.parametrize("needed, here, ok", [(2, 1, True), (2, 2, False)])
def test_fewer_gpus_only_when_fewer(needed, here, ok):
    assert skips.allowed(skips.fewer_gpus(needed, here), **_in("gpu")) is ok


def test_a_modules_markers_are_read_from_its_source(tmp_path: Path):
    (tmp_path / "a.py").write_text(
        "import pytest\npytestmark = [pytest.mark.hf, pytest.mark.slow]\n"
    )
    (tmp_path / "b.py").write_text("import pytest\npytestmark = pytest.mark.compat\n")
    (tmp_path / "c.py").write_text("import pytest\nx = pytest.mark.hf\n")
    assert module_marks(tmp_path / "a.py") == {"hf", "slow"}
    assert module_marks(tmp_path / "b.py") == {"compat"}
    assert module_marks(tmp_path / "c.py") == set()
