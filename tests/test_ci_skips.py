"""Under CI=true a skip fails the stage (tests/conftest.py) unless its reason is one of
tests/skips.py's: no GPU, fewer GPUs than needed, the other torch version's branch, an extra's
package in a run outside its stage. Markers allow nothing: a `gpu` or `compat` test skipping for
another reason fails too. Each case runs pytest on a small test file with this suite's conftest."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

pytestmark = pytest.mark.slow  # pytest runs of their own: the slow stage keeps command 2 short

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
    pytest.skip(other_torch("this torch has no such interface"))
"""
FAILING = ["test_slurm_missing", "test_gpu_test_skipping_for_slurm",
           "test_compat_test_skipping_in_its_own_words", "test_as_many_gpus_as_needed"]  # fmt: skip
ALLOWED = ["no CUDA device (torch.cuda.is_available() is False)", "needs 2 GPUs, 1 here",
           "the other torch version's branch: this torch has no such interface"]  # fmt: skip
HF_MODULE = """
import pytest

pytestmark = pytest.mark.hf
pytest.skip("could not import 'transformers': No module named 'transformers'", allow_module_level=True)
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
    return tmp_path


def test_under_ci_only_the_allowed_reasons_stay_skips(folder):
    local = _pytest(folder, False, "test_cases.py")
    assert local.returncode == 0 and "8 skipped" in local.stdout, local.stdout
    ci = _pytest(folder, True, "test_cases.py")
    assert ci.returncode == 1, ci.stdout
    # a skip in the call fails it; a skipif (at set-up) errors
    assert "4 failed, 3 skipped, 1 error" in ci.stdout, ci.stdout
    for name in FAILING:
        assert f"FAILED test_cases.py::{name} - skipped under CI=true" in ci.stdout, ci.stdout
    assert "ERROR test_cases.py::test_data_missing - skipped under CI=true" in ci.stdout
    assert "Slurm packages missing" in ci.stdout and "fashion-mnist missing" in ci.stdout
    for reason in ALLOWED:  # skipped, with their reasons printed
        assert f": {reason}\n" in ci.stdout and "SKIPPED [1] test_cases.py" in ci.stdout, reason


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
