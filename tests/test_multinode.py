"""Two nodes on one machine through torchrun's c10d rendezvous, and preemption without Slurm.

Every run here is HSDP 2 x 2 on 4 CPU ranks and must reproduce one local 4-rank run (the
reference, shared with ``test_slurm.py``) step for step, bit for bit.
"""

from __future__ import annotations

import functools
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, Run, assert_close_lists, cli_env, read_metrics, train
from fsdp2lab.training.preemption import should_requeue

MULTINODE = Path(__file__).resolve().parents[1] / "scripts" / "multinode-torchrun.sh"
STEPS = 12
RUN = ["--model", "mlp", *TINY, "--max-steps", str(STEPS), "--log-every-steps", "1",
       "--global-batch-size", "32"]  # fmt: skip
HSDP_2X2 = ["--dp-replicate", "2", "--dp-shard", "2"]
# Testing aid: slow steps, so that a signal sent once step 3 is logged lands mid-run.
SLOW_STEPS = {"FSDP2LAB_STEP_DELAY_S": "0.5"}


@functools.cache
def reference_run(where: Path) -> Run:
    """The uninterrupted local run: 4 standalone ranks, HSDP 2 x 2, final weights in ref.pt."""
    where.mkdir(parents=True, exist_ok=True)
    return train(where, *RUN, *HSDP_2X2, "--nproc-per-node", "4", "--save-model", "ref.pt",
                 name="reference")  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Run]:
    where = tmp_path_factory.getbasetemp() / "multinode-reference"
    return where, reference_run(where)


def same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


def step_losses(metrics: list[dict]) -> dict[int, float]:
    """Step -> loss; a step logged twice (a resumed run repeating it) fails the test."""
    steps = [r["step"] for r in metrics if r["event"] == "step"]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in metrics if r["event"] == "step"}


def assert_matches_reference(metrics: list[dict], weights: Path, reference) -> None:
    ref_dir, ref = reference
    got, want = step_losses(metrics), step_losses(ref.metrics)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    assert_close_lists([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], 0.0)
    assert same_weights(weights, ref_dir / "ref.pt")


def last_step(metrics: Path) -> int:
    """The last step logged in a metrics file being written (0: none yet)."""
    try:
        return max((r["step"] for r in read_metrics(metrics) if r["event"] == "step"), default=0)
    except json.JSONDecodeError:  # a line being written
        return 0


def wait_for_step(metrics: Path, step: int, alive, timeout: float = 240) -> None:
    """Poll the metrics file until ``step`` is logged; fail if the run ends or stalls first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if last_step(metrics) >= step:
            return
        if not alive():
            pytest.fail(f"the run ended before step {step} was logged in {metrics}")
        time.sleep(0.1)
    pytest.fail(f"step {step} not logged in {metrics} after {timeout:.0f}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_on_one_machine_equal_one_node(reference, tmp_path):
    """scripts/multinode-torchrun.sh on two "nodes": torchrun agents meet by c10d rendezvous."""
    head = f"127.0.0.1:{free_port()}"
    metrics = tmp_path / "metrics.jsonl"
    cmd = [str(MULTINODE), "--nnodes", "2", "--head", head, "--nproc-per-node", "2", "--",
           *RUN, "--metrics-file", str(metrics), "--save-model", "final.pt"]  # fmt: skip
    env = cli_env({"FSDP2LAB_PYTHON": sys.executable})
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, **out) for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    torchrun = (
        f"-m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d "
        f"--rdzv-endpoint {head} --rdzv-id fsdp2lab -m fsdp2lab train"
    )
    assert all(torchrun in o and "--dp-replicate 2 --dp-shard 2" in o for o in outputs)
    assert sum("fsdp2 on 4 rank(s)" in o for o in outputs) == 1  # global rank 0 alone prints
    summary = next(r for r in read_metrics(metrics) if r["event"] == "summary")
    assert summary["world_size"] == 4
    assert summary["mesh"] == {"shape": [2, 2], "names": ["dp_replicate", "dp_shard"]}
    assert_matches_reference(read_metrics(metrics), tmp_path / "final.pt", reference)


def test_multinode_script_static_rendezvous_and_bad_usage():
    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(MULTINODE), *args], capture_output=True, text=True)

    static = script("--nnodes", "3", "--head", "node1:1234", "--node-rank", "2",
                    "--nproc-per-node", "4", "--dry-run", "--", "--tp", "2")  # fmt: skip
    assert static.returncode == 0, static.stderr
    assert (
        "-m torch.distributed.run --nnodes 3 --nproc-per-node 4 --node-rank 2 --master-addr node1 "
        "--master-port 1234 -m fsdp2lab train"
    ) in static.stderr
    assert static.stderr.rstrip().endswith("--tp 2")  # a mesh flag: no HSDP defaults added
    for args, message in [
        (["--head", "h"], "--nnodes N is required"),
        (["--nnodes", "2", "--head", "h", "--node-rank", "2"], "--node-rank must be 0..1"),
        (["--nnodes", "2", "--head", "h", "--model", "gpt"], "unknown option '--model'"),
    ]:
        bad = script(*args)
        assert bad.returncode == 2 and f"multinode-torchrun: error: {message}" in bad.stderr


def _train_until_signalled(tmp_path: Path, signum: int, *args: str) -> tuple[Run, int]:
    """Start a slow standalone run, send ``signum`` to the launcher once step 3 is logged."""
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "fsdp2lab", "train", *RUN, "--metrics-file", str(metrics),
           "--save-model", "final.pt", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(SLOW_STEPS), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for_step(metrics, 3, alive=lambda: proc.poll() is None)
    sent_after = max(step_losses(read_metrics(metrics)))
    proc.send_signal(signum)  # the launcher passes it to every worker
    out, err = proc.communicate(timeout=300)
    return Run(proc.returncode, out, err, read_metrics(metrics)), sent_after


@pytest.mark.drills  # a real SIGTERM to a 4-rank run, then its resume
def test_sigterm_without_slurm_checkpoints_exits_cleanly_and_resumes_exactly(reference, tmp_path):
    four_ranks = [*HSDP_2X2, "--nproc-per-node", "4", "--ckpt-dir", "ckpt"]
    stopped, sent_after = _train_until_signalled(tmp_path, signal.SIGTERM, *four_ranks)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert len(saved) == 1 and sent_after <= saved[0] < STEPS, (saved, sent_after)
    k = saved[0]
    assert f"fsdp2lab: preemption: SIGTERM after step {k}; saved in ckpt; not under Slurm" in (
        stopped.stdout
    )
    assert max(step_losses(stopped.metrics)) == k and not stopped.events("summary")
    assert not (tmp_path / "final.pt").exists()  # the model is saved only when training ends
    assert "Traceback" not in stopped.stderr

    # The same command again resumes at step k + 1 and ends exactly as the uninterrupted run.
    resumed = train(tmp_path, *RUN, *four_ranks, "--save-model", "final.pt", name="resumed")
    assert f"resumed from ckpt/step-{k}: step {k}" in resumed.stdout
    assert_matches_reference(stopped.metrics + resumed.metrics, tmp_path / "final.pt", reference)


def test_usr1_without_a_checkpoint_dir_stops_cleanly_without_saving(tmp_path):
    stopped, sent_after = _train_until_signalled(tmp_path, signal.SIGUSR1, "--nproc-per-node", "2")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    last = max(step_losses(stopped.metrics))
    assert sent_after <= last < STEPS
    assert f"preemption: SIGUSR1 at step {last}; no --ckpt-dir, so nothing is saved" in (
        stopped.stdout
    )
    assert not stopped.events("summary") and not (tmp_path / "final.pt").exists()


def test_only_usr1_or_a_time_limit_or_preemption_requeues():
    # What `scontrol show job` (Slurm 22.05) said inside tasks that had just received SIGTERM.
    cancelled = "JobId=7 JobName=x\n   JobState=COMPLETING Reason=None Dependency=(null)\n"
    timed_out = "JobId=5 JobName=x\n   JobState=COMPLETING Reason=TimeLimit Dependency=(null)\n"
    assert should_requeue(signal.SIGUSR1, "") and should_requeue(signal.SIGUSR1, cancelled)
    assert should_requeue(signal.SIGTERM, timed_out)
    assert should_requeue(signal.SIGTERM, "   JobState=PREEMPTED Reason=None\n")
    assert not should_requeue(signal.SIGTERM, cancelled)
    assert not should_requeue(signal.SIGTERM, "")  # scontrol failed: do not undo a scancel


def test_preemption_checks_agree_on_every_rank(tmp_path):
    """Rank 1 alone receives SIGUSR1 before the third check: through gloo in the background, every
    rank's fourth check says so (the third's verdict is read a check later), no rank's earlier;
    a blocking check says so at once."""
    script = Path(__file__).parent / "scripts" / "check_preemption_checks.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path)],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    usr1 = int(signal.SIGUSR1)
    for rank in (0, 1):
        verdicts = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert verdicts[:4] == [0, 0, 0, usr1]
        assert verdicts[-1] == usr1
