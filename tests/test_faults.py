"""Fault drills, each run for real through the CLI on 2 gloo ranks: the fault is detected, reported
once, and nothing is lost (the resumed run's losses equal those of a run never interrupted).

``pytest tests/test_faults.py -s`` prints how long each detection took (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, Run, cli_env, read_metrics, run_cli, tmpfs, train
from fsdp2lab.checkpoint import layout

# Real kills, hangs and full disks take minutes: .ci/run runs them in their own stage.
pytestmark = pytest.mark.drills

STEPS = 10
RUN = ["--model", "mlp", *TINY, "--nproc-per-node", "2", "--max-steps", str(STEPS)]
RUN += ["--log-every-steps", "1", "--ckpt-every-steps", "2"]
CKPT = ["--ckpt-dir", "ckpt"]
SLOW = {"FSDP2LAB_STEP_DELAY_S": "0.5"}  # time to act between steps


def losses(run: Run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.events("step")}


def same_losses(runs: list[Run], want: dict[int, float]) -> None:
    """Every step any run logged has the reference's loss; together they cover the whole run."""
    got: dict[int, float] = {}
    for run in runs:
        for step, loss in losses(run).items():
            assert loss == want[step], (step, loss, want[step])
            got[step] = loss
    assert sorted(got) == sorted(want)


def report(what: str, seconds: float) -> None:
    print(f"\n[drill] {what}: {seconds:.1f} s", flush=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = train(tmp_path_factory.mktemp("reference"), *RUN, *CKPT, name="ref")
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    return losses(run)


def _steps_done(metrics: Path) -> int:
    lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
    steps = [json.loads(line).get("step", 0) for line in lines if '"event": "step"' in line]
    return max(steps, default=0)


def _workers(launcher: int) -> dict[int, int]:
    """The launcher's worker processes by rank."""
    found = {}
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
        found[rank[0]] = int(pid)
    return found


def train_and_act(tmp_path: Path, *args: str, env: dict, at_step: int, act, name: str):
    """Train; once ``at_step`` is logged, ``act(launcher_process)``. Returns the run and the
    seconds from the act to the job's end."""
    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp2lab", "train", *args, "--metrics-file", str(metrics)],
        cwd=tmp_path, env=cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while _steps_done(metrics) < at_step:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not reach the step"
            time.sleep(0.05)
        acted = time.monotonic()
        act(proc)
        out, err = proc.communicate(timeout=120)
        return Run(proc.returncode, out, err, read_metrics(metrics)), time.monotonic() - acted
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the job
        proc.wait()


def test_kill_9_of_a_rank_mid_step_ends_the_job_and_resume_loses_nothing(reference, tmp_path):
    def kill_rank_1(proc):
        os.kill(_workers(proc.pid)[1], signal.SIGKILL)

    run, took = train_and_act(
        tmp_path, *RUN, *CKPT, env=SLOW, at_step=5, act=kill_rank_1, name="killed"
    )
    report("kill -9 of rank 1: job ended after", took)
    assert run.returncode == 1 and took < 30
    assert run.stderr.count("fsdp2lab: error: rank 1 was killed by SIGKILL") == 1
    assert "Traceback" not in run.stderr
    saved = layout.complete_folders(tmp_path / "ckpt")[-1].name
    resumed = train(tmp_path, *RUN, *CKPT, name="resumed")
    assert f"resumed from ckpt/{saved}" in resumed.stdout
    same_losses([run, resumed], reference)


@pytest.mark.parametrize("hung", [1, 0])  # rank 0 also hosts the c10d store
def test_a_hung_rank_is_reported_once_by_the_watchdog_and_every_rank_ends(
    reference, tmp_path, hung
):
    timeout = 10

    def stop_it(proc):
        os.kill(_workers(proc.pid)[hung], signal.SIGSTOP)

    run, took = train_and_act(
        tmp_path, *RUN, *CKPT, "--collective-timeout", str(timeout),
        env=SLOW, at_step=3, act=stop_it, name="hung",
    )  # fmt: skip
    report(f"SIGSTOP of rank {hung} (--collective-timeout {timeout}): job ended after", took)
    assert run.returncode == 3, run.stderr[-3000:]
    found = re.findall(
        rf"rank {hung} stopped responding at step (\d+) \(no heartbeat for (\d+) s\)", run.stderr
    )
    # The watcher knows the step from the beats: one every 0.5 s (a tenth of the half timeout),
    # read every 0.5 s, so up to 1 s (two steps of SLOW's 0.5 s) behind the step acted at.
    assert len(found) == 1 and 1 <= int(found[0][0]) <= 3 and int(found[0][1]) >= timeout / 2
    assert "Traceback" not in run.stderr
    assert took < timeout + 15  # reported at half the timeout; the launcher's grace is 5 s
    resumed = train(tmp_path, *RUN, *CKPT, name="resumed")
    same_losses([run, resumed], reference)


def test_kill_9_of_the_job_during_an_async_save_then_resume(reference, tmp_path):
    # Rank 0's write of step 4 hangs, so that save is still in flight when the job is killed.
    env = {**SLOW, "FSDP2LAB_CKPT_STALL_AT": "0:4"}
    run, _ = train_and_act(
        tmp_path, *RUN, *CKPT, "--async-checkpoint", env=env, at_step=5,
        act=lambda proc: os.killpg(proc.pid, signal.SIGKILL), name="killed",
    )  # fmt: skip
    # Killed mid-run: no summary, no step after the one it was killed at (the kill landed).
    assert not run.events("summary") and max(losses(run)) < STEPS, losses(run)
    root = tmp_path / "ckpt"
    assert [p.name for p in layout.step_folders(root)] == ["step-2", "step-4"]
    assert not layout.is_complete(root / "step-4") and layout.read_latest(root) == "step-2"
    resumed = train(tmp_path, *RUN, *CKPT, "--async-checkpoint", name="resumed")
    assert f"skipping incomplete checkpoint {Path('ckpt/step-4')}" in resumed.stdout
    assert "resumed from ckpt/step-2: step 2" in resumed.stdout
    same_losses([run, resumed], reference)


def test_nan_stops_before_its_update_without_saving_and_resume_is_exact(reference, tmp_path):
    t0 = time.monotonic()
    run = train(tmp_path, *RUN, *CKPT, env={"FSDP2LAB_NAN_AT": "1:5"}, check=False, name="nan")
    report("NaN loss on rank 1 at step 5 (--on-nan stop): run took", time.monotonic() - t0)
    assert run.returncode == 1
    message = "fsdp2lab: error: non-finite loss and gradient at step 5: training stopped"
    assert run.stderr.count(message) == 1 and "Traceback" not in run.stderr
    root = tmp_path / "ckpt"
    assert [p.name for p in layout.step_folders(root)] == ["step-2", "step-4"]
    assert sorted(losses(run)) == [1, 2, 3, 4]
    resumed = train(tmp_path, *RUN, *CKPT, name="resumed")
    assert "resumed from ckpt/step-4: step 4" in resumed.stdout
    same_losses([run, resumed], reference)


def test_nan_skip_drops_that_update_and_training_goes_on(tmp_path):
    run = train(
        tmp_path, *RUN[: RUN.index("--ckpt-every-steps")], "--on-nan", "skip",
        env={"FSDP2LAB_NAN_AT": "0:3"}, name="skip",
    )  # fmt: skip
    assert run.stdout.count("non-finite loss and gradient at step 3: update skipped") == 1
    logged = losses(run)
    assert sorted(logged) == list(range(1, STEPS + 1)) and math.isnan(logged[3])
    assert all(math.isfinite(v) for s, v in logged.items() if s != 3)
    assert math.isfinite(run.summary["final_test_loss"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_that_fails_for_lack_of_space_is_reported_and_training_goes_on(
    reference, tmp_path, mode
):
    extra = ["--keep-last", "0", *(["--async-checkpoint"] if mode == "async" else [])]
    env = {"FSDP2LAB_CKPT_ENOSPC_AT": "1:4"}
    run = train(tmp_path, *RUN, *CKPT, *extra, env=env, name=mode)
    warning = "fsdp2lab: warning: checkpoint not saved: ckpt/step-4: rank 1: [Errno 28] No space"
    assert run.stdout.count(warning) == 1, run.stdout[-3000:]
    root = tmp_path / "ckpt"
    assert [p.name for p in layout.step_folders(root)] == ["step-2", "step-6", "step-8", "step-10"]
    same_losses([run], reference)  # the training state was never touched


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MB tmpfs: room for one checkpoint of the mlp (1.5 MB), not two (needs root)."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        yield disk


def test_a_full_disk_keeps_the_last_checkpoint_and_resume_is_exact(reference, tmp_path, tiny_disk):
    run = train(tmp_path, *RUN, "--ckpt-dir", "disk/ckpt", check=False, name="full")
    assert run.returncode == 1
    assert "fsdp2lab: warning: checkpoint not saved: disk/ckpt/step-4" in run.stdout
    assert re.search(
        r"\(0\.\d MB free\); training goes on, --resume auto would take step-2", run.stdout
    )
    assert "fsdp2lab: error: the run's last checkpoint was not saved" in run.stderr
    root = tiny_disk / "ckpt"
    assert [p.name for p in layout.step_folders(root)] == ["step-2"]
    assert layout.read_latest(root) == "step-2"
    same_losses([run], reference)
    resumed = train(tmp_path, *RUN, "--resume", "disk/ckpt", *CKPT, name="resumed")
    assert "resumed from disk/ckpt/step-2: step 2" in resumed.stdout
    same_losses([resumed], {s: v for s, v in reference.items() if s > 2})


def test_an_unwritable_checkpoint_dir_is_found_before_training(tmp_path):
    (tmp_path / "a-file").write_text("")
    proc = run_cli(["train", *RUN, "--ckpt-dir", "a-file/ckpt"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "fsdp2lab: error: --ckpt-dir a-file/ckpt is not writable: Not a directory"
    )
    assert "Train Epoch" not in proc.stdout
