"""Shared helpers: run the real ``fsdp2lab`` CLI in subprocesses (real gloo process groups on CPU)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import skips
from fsdp2lab.runtime.distributed import Runtime

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

# Under CI=true a skip is a failure: a stage must not pass while doing nothing because a system
# part (Slurm, Fashion-MNIST, transformers in the hf stage, root for a tmpfs) is missing. Only the
# reasons of tests/skips.py are allowed (no GPU where there is none, fewer GPUs than needed, a
# compat test's branch for another torch version, an extra's package in a test or module of that
# extra's stage in a run outside it). `-ra` (pyproject.toml) prints every skip's reason.
CI = os.environ.get("CI", "").lower() in ("true", "1")


def _stage_runs(config: pytest.Config, marker: str) -> bool:
    """Whether this run's ``-m`` expression selects a test marked only ``marker``."""
    from _pytest.mark.expression import Expression

    expr = config.option.markexpr
    return not expr or Expression.compile(expr).evaluate(lambda name, **_: name == marker)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _fail_skip(report, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, which allows no skip for a missing part: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        marks = {mark.name for mark in item.iter_markers()}
        if not skips.allowed(reason, lambda m: _stage_runs(item.config, m), marks):
            _fail_skip(report, reason)


def module_marks(path: Path) -> set[str]:
    """The markers a test module's own ``pytestmark`` names (read from its source: a module that
    skips while it is imported has no module object to ask)."""
    import ast

    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return set()
    marks = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        named = any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets)
        if named and getattr(node, "value", None) is not None:
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == "pytest.mark":
                    marks.add(sub.attr)
    return marks


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if CI and report.skipped:
        reason = _skip_reason(report)
        marks = module_marks(collector.path) if isinstance(collector, pytest.Module) else set()
        if not skips.allowed(reason, lambda m: _stage_runs(collector.config, m), marks):
            _fail_skip(report, reason)


# Small, fast, exact: synthetic data, no dropout, fp32.
TINY = ["--dataset", "synthetic", "--synthetic-size", "1024", "--progress", "off", "--dropout", "0"]
GPT_TINY = [
    "--model",
    "gpt",
    "--n-layers",
    "2",
    "--d-model",
    "32",
    "--n-heads",
    "4",
    "--seq-len",
    "16",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    metrics: list[dict]

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.metrics if r["event"] == kind]

    @property
    def step_losses(self) -> list[float]:
        return [r["loss"] for r in self.events("step")]

    @property
    def summary(self) -> dict:
        (summary,) = self.events("summary")
        return summary


def cli_env(extra: dict | None = None) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


PROBED_CLI = Path(__file__).parent / "scripts" / "probed_cli.py"


def run_cli(
    args: list[str],
    *,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 300,
    probe: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m fsdp2lab ARGS`` in a subprocess; with ``probe``, under torch's global hooks
    that write what they see there (tests/scripts/probed_cli.py: one-rank runs)."""
    entry = ["-m", "fsdp2lab"] if probe is None else [str(PROBED_CLI), str(probe)]
    return subprocess.run(
        [sys.executable, *entry, *args],
        cwd=cwd,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(
    tmp_path: Path,
    *args: str,
    name: str = "run",
    env: dict | None = None,
    check: bool = True,
    timeout: float = 300,
    probe: Path | None = None,
) -> Run:
    """Run ``fsdp2lab train`` with a metrics file; fail the test with the output if it fails."""
    metrics = tmp_path / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    proc = run_cli(
        ["train", *args, "--metrics-file", str(metrics)],
        cwd=tmp_path,
        env=env,
        timeout=timeout,
        probe=probe,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"fsdp2lab train {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return Run(proc.returncode, proc.stdout, proc.stderr, read_metrics(metrics))


def assert_close_lists(a: list[float], b: list[float], tol: float) -> None:
    assert len(a) == len(b) and len(a) > 0, (len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= tol, f"max difference {worst:.3e} > {tol:.0e}\n{a}\n{b}"


VARIANTS_SCRIPT = Path(__file__).parent / "scripts" / "resume_matrix.py"


def run_variants(out: Path, ranks: int, variants: dict, common: list[str]) -> None:
    """Train ``variants`` one after another in the same ``ranks`` torchrun workers
    (tests/scripts/resume_matrix.py: resume checks, mutations of the loaded state, fault env)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(VARIANTS_SCRIPT), str(out), json.dumps(variants), *common]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def saved_checkpoint(ckpt: Path) -> dict:
    """A DCP checkpoint as one plain dict of tensors and values (read in this process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = ckpt.parent / f"{ckpt.name}.pt"
    if not flat.exists():
        dcp_to_torch_save(ckpt, flat)
    return torch.load(flat, weights_only=False)


def same_values(a: dict, b: dict) -> list[str]:
    """The keys where two flat state dicts differ (tensors bitwise, dtype included)."""
    keys = sorted(set(a) | set(b))

    def differ(x, y) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.dtype != y.dtype or not torch.equal(x, y)
        return x != y

    return [k for k in keys if k not in a or k not in b or differ(a[k], b[k])]


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A real small disk (a tmpfs of ``size``, e.g. "2m") mounted on ``folder`` while the block
    runs: writes past it fail with ENOSPC as on a full disk. Needs root (skips otherwise)."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    if not shutil.which("mount") or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(autouse=True)
def _consent_lasts_one_test():
    """What a test's command line consented to (fsdp2lab.consent) ends with it, as with a command."""
    yield
    if consent := sys.modules.get("fsdp2lab.consent"):
        consent.reset()


@pytest.fixture
def one_rank(tmp_path: Path):
    """A one-rank gloo process group in this process, as the trainer runs under."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1
    )
    yield Runtime(0, 1, 0, torch.device("cpu"), "gloo")
    dist.destroy_process_group()
