"""The project's own ``slurm/*.sbatch``, unchanged, on a real two-node Slurm cluster.

``scripts/local-slurm.sh`` runs slurmctld and two slurmds (node1, node2) on this machine; the
jobs are submitted with ``sbatch`` like on any cluster, with CPU-sized arguments. No mocks: the
scripts, srun, torchrun, signals and ``scontrol requeue`` are the real ones. Needs root and the
Debian packages slurmctld, slurmd, slurm-client and munge (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import cli_env, read_metrics
from test_multinode import (
    RUN,
    SLOW_STEPS,
    STEPS,
    assert_matches_reference,
    last_step,
    reference_run,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO / "scripts" / "local-slurm.sh"
SCRIPTS = {
    "srun": REPO / "slurm" / "train.sbatch",
    "torchrun": REPO / "slurm" / "train-torchrun.sbatch",
}
JOB_NAMES = {"srun": "fsdp2lab", "torchrun": "fsdp2lab-torchrun"}  # their #SBATCH --job-name
# The plain jobs are submitted as the README shows (the scripts ask --cpus-per-task=4, which the
# local nodes' 8 CPUs take); jobs that must run side by side ask 1 CPU per task.
SIDE_BY_SIDE = ["--cpus-per-task=1"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def _missing_packages() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    wanted = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
              "munged": "munge"}  # fmt: skip
    return sorted({pkg for exe, pkg in wanted.items() if not shutil.which(exe, path=path)})


@dataclass
class Cluster:
    env: dict  # the environment jobs are submitted with: SLURM_CONF, FSDP2LAB_PYTHON
    state_dir: Path

    def run(self, *cmd: str) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"
        return proc.stdout

    def submit(
        self, kind: str, workdir: Path, *args: str, env: dict | None = None, sbatch: tuple = ()
    ) -> Job:
        job_env = {**self.env, **(env or {})}
        cmd = ["sbatch", "--parsable", *sbatch, str(SCRIPTS[kind]), *RUN, *args]
        proc = subprocess.run(cmd, cwd=workdir, env=job_env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().split(";")[0]
        return Job(self, kind, job_id, workdir)

    def runs_of(self, job_id: str) -> list[str]:
        """Final state of each run of the job, oldest first (a requeued run shows PENDING)."""
        log = self.state_dir / "jobcomp.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return [re.search(r"JobState=(\S+)", ln)[1] for ln in lines if f"JobId={job_id} " in ln]


@dataclass
class Job:
    cluster: Cluster
    kind: str
    id: str
    workdir: Path  # the submit dir: the log, runs/ and final.pt are here

    @property
    def log(self) -> Path:
        return self.workdir / f"{JOB_NAMES[self.kind]}-{self.id}.out"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / f"{JOB_NAMES[self.kind]}-{self.id}"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def running(self) -> bool:
        return bool(self.cluster.run("squeue", "-h", "-j", self.id, "-o", "%T").strip())

    def wait(self, timeout: float = 400) -> str:
        """Poll until the job has left the queue for good; its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runs = self.cluster.runs_of(self.id)
            if runs and runs[-1] in ENDED and not self.running():
                return runs[-1]
            time.sleep(0.5)
        pytest.fail(f"job {self.id} still queued after {timeout:.0f}s\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else f"(no {self.log})"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A two-node Slurm cluster for this module; stopped and deleted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root (slurmctld, slurmd and munged run as root)")
    missing = _missing_packages()
    if missing:
        pytest.skip(f"Slurm packages missing: {' '.join(missing)} (.ci/run installs them)")
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "FSDP2LAB_SLURM_DIR": str(state)}
    env.pop("FSDP2LAB_SLURM_CPUS", None)  # the default, as a user gets it
    start = subprocess.run([str(LOCAL_SLURM), "start"], env=env, capture_output=True, text=True)
    if start.returncode == 2:
        pytest.skip(f"local Slurm cluster unavailable: {start.stderr.strip()}")
    assert start.returncode == 0, start.stderr
    job_env = cli_env({"SLURM_CONF": str(state / "slurm.conf"), "FSDP2LAB_PYTHON": sys.executable})
    try:
        yield Cluster(job_env, state)
    finally:
        subprocess.run([str(LOCAL_SLURM), "stop", "--purge"], env=env, capture_output=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    where = tmp_path_factory.getbasetemp() / "multinode-reference"
    return where, reference_run(where)


def _check_trained_two_nodes(job: Job, state: str, reference) -> list[dict]:
    output = job.output()
    assert state == "COMPLETED", output[-4000:]
    ranks = "task(s)" if job.kind == "srun" else "worker(s)"
    layout = f"2 node(s) [node[1-2]] x 2 {ranks}, no GPU: CPU ranks, gloo"
    assert f"fsdp2lab-slurm: job {job.id} run 1: {layout}" in output
    assert "fsdp2 on 4 rank(s) [cpu/gloo], mesh dp_replicate=2 x dp_shard=2" in output
    metrics = read_metrics(job.metrics)
    (summary,) = [r for r in metrics if r["event"] == "summary"]
    assert summary["world_size"] == 4 and summary["mesh"]["shape"] == [2, 2]
    assert_matches_reference(metrics, job.workdir / "final.pt", reference)
    return metrics


def test_the_two_nodes_share_no_shm_pid_space_or_host_name(cluster, tmp_path):
    """Each slurmd runs in namespaces of its own, as on two machines: a job's tasks on node1 and
    node2 see different host names, PID and mount namespaces, and an empty private /dev/shm."""
    probe = 'echo "$(hostname) $(readlink /proc/self/ns/pid) $(readlink /proc/self/ns/mnt) $(ls -A /dev/shm | wc -l)"'
    out = tmp_path / "probe.out"
    cluster.run("sbatch", "--wait", "-N2", "--ntasks-per-node=1", "-o", str(out),
                "--wrap", f"srun sh -c '{probe}'")  # fmt: skip
    rows = sorted(line.split() for line in out.read_text().splitlines())
    assert [r[0] for r in rows] == ["node1", "node2"], rows
    mine = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "mnt")]
    for ns in (1, 2):  # pid, mnt: each node its own, neither this process's
        assert rows[0][ns] != rows[1][ns] and mine[ns - 1] not in (rows[0][ns], rows[1][ns])
    assert [r[3] for r in rows] == ["0", "0"], rows  # nothing in either node's /dev/shm


def test_status_says_why_a_job_waits(cluster):
    job_id = cluster.run("sbatch", "--parsable", "--begin=now+3600", "--wrap", "true").strip()
    try:
        deadline = time.monotonic() + 60  # the reason is set at the scheduler's next pass
        env = {**cluster.env, "FSDP2LAB_SLURM_DIR": str(cluster.state_dir)}
        while True:
            status = subprocess.run(
                [str(LOCAL_SLURM), "status"], env=env, capture_output=True, text=True
            )
            assert status.returncode == 0, status.stderr
            if f"{job_id} wrap BeginTime" in status.stdout or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert "pending jobs (id name reason):" in status.stdout
        assert f"{job_id} wrap BeginTime" in status.stdout, status.stdout
    finally:
        cluster.run("scancel", job_id)


@pytest.fixture(scope="module")
def plain_jobs(cluster, tmp_path_factory) -> dict[str, Job]:
    """One uninterrupted job of each script, submitted together (they run side by side)."""
    return {
        kind: cluster.submit(kind, tmp_path_factory.mktemp(kind), "--save-model", "final.pt")
        for kind in SCRIPTS
    }


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_sbatch_script_trains_two_nodes_like_one_local_run(plain_jobs, cluster, reference, kind):
    job = plain_jobs[kind]
    state = job.wait()
    _check_trained_two_nodes(job, state, reference)
    assert cluster.runs_of(job.id) == ["COMPLETED"]


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_end(cluster, reference, tmp_path):
    """Both scripts at once: USR1 to the batch shell (srun) and to the job's steps (torchrun)."""
    jobs = {}
    for kind in SCRIPTS:
        (tmp_path / kind).mkdir()
        jobs[kind] = cluster.submit(kind, tmp_path / kind, "--save-model", "final.pt",
                                    env=SLOW_STEPS, sbatch=SIDE_BY_SIDE)  # fmt: skip
    # Each job gets USR1 as soon as it has logged step 3 (polled side by side).
    how = {"srun": ["--batch"], "torchrun": []}
    sent_after: dict[str, int] = {}
    deadline = time.monotonic() + 300
    while len(sent_after) < len(jobs):
        for kind, job in jobs.items():
            if kind in sent_after:
                continue
            step = last_step(job.metrics)
            if step >= 3:
                cluster.run("scancel", "--signal=USR1", *how[kind], job.id)
                sent_after[kind] = step
            elif not job.running():
                pytest.fail(f"job {job.id} ended before step 3\n{job.output()[-3000:]}")
        assert time.monotonic() < deadline, f"step 3 not reached: {sent_after}"
        time.sleep(0.1)
    for kind, job in jobs.items():
        state = job.wait()
        output = job.output()
        metrics = _check_trained_two_nodes(job, state, reference)
        stops = re.findall(r"preemption: SIGUSR1 after step (\d+); saved in (\S+); (.*)", output)
        assert len(stops) == 1, output[-4000:]
        k, where, outcome = int(stops[0][0]), stops[0][1], stops[0][2]
        assert sent_after[kind] <= k < STEPS, (sent_after[kind], k)
        assert where == str(job.run_dir / "checkpoints")
        assert outcome == f"job {job.id} requeued; it resumes from the checkpoint"
        assert f"fsdp2lab-slurm: job {job.id} run 2: " in output
        assert f"resumed from {where}/step-{k}: step {k}" in output
        assert cluster.runs_of(job.id) == ["PENDING", "COMPLETED"]  # requeued once, then done
        steps = [r["step"] for r in metrics if r["event"] == "step"]
        assert steps == list(range(1, STEPS + 1))  # run 1 logged 1..k, run 2 k+1..12


def test_readme_slurm_commands_run_as_written(cluster, tmp_path):
    """The README's ``srun`` and ``sbatch`` lines (tests/test_readme.py leaves them to this test)."""
    shutil.copy(REPO / "README.md", tmp_path)
    shutil.copytree(REPO / "slurm", tmp_path / "slurm")
    env = {**cluster.env, "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}"}
    commands = [
        "srun --ntasks-per-node 2 fsdp2lab train",
        "sbatch --wait slurm/train.sbatch --model gpt --dataset text --text-file README.md "
        "--epochs 3",
    ]
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", f"{command} --max-steps 2"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        logs = "".join(p.read_text() for p in tmp_path.glob("*.out"))
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}\n{logs[-3000:]}"
    assert "fsdp2 on 4 rank(s) [cpu/gloo], mesh dp_replicate=2 x dp_shard=2" in logs
