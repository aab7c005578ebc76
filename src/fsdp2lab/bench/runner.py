"""Run a planned sweep: each run is its own ``fsdp2lab train`` job, in its own folder.

``RESULTS/<run>/`` holds ``config.toml`` (the run's train keys), ``command.txt``, ``stdout.log``,
``stderr.log``, ``metrics.jsonl`` and ``status.json`` (ok or failed, exit code, wall time). A run
that fails or times out is recorded as failed and the sweep goes on. A side-by-side run starts its
one-rank copies at once; copy ``i`` > 0 writes ``stdout-i.log``, ``stderr-i.log``,
``metrics-i.jsonl``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from fsdp2lab import consent
from fsdp2lab.bench.sweep import RunSpec, to_toml
from fsdp2lab.config import CODE_KEYS, OUTPUT_PATH_KEYS
from fsdp2lab.errors import UsageError
from fsdp2lab.runtime.local_launcher import free_port

# A launcher's rank variables must not leak into the runs it starts.
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_GRACE_S = 10.0


def pick_launcher(choice: str) -> str:
    """``auto``: ``srun`` inside a Slurm allocation (SLURM_JOB_ID set), else local workers."""
    in_allocation = "SLURM_JOB_ID" in os.environ
    if choice == "auto":
        return "srun" if in_allocation and shutil.which("srun") else "local"
    if choice == "srun" and not (in_allocation and shutil.which("srun")):
        raise UsageError("--launcher srun needs a Slurm allocation (salloc/sbatch) and srun")
    return choice


def copy_suffix(copy: int) -> str:
    return f"-{copy}" if copy else ""


def command(
    run: RunSpec,
    folder: Path,
    launcher: str,
    srun_args: str = "",
    copy: int = 0,
    profile: bool = False,
    allow_code: bool = False,
    allow_paths: bool = False,
) -> list[str]:
    """The run's ``fsdp2lab train`` command: its keys from its config file, and on its command
    line the consent its user gave (``--allow-code``, ``--allow-paths``, and the code and paths
    the user typed, so that they are the user's there too)."""
    ranks = run.world_size // run.copies
    train = [
        sys.executable,
        "-m",
        "fsdp2lab",
        "train",
        "--config",
        str(folder / "config.toml"),
        *consent.typed_flags(run.values, (*CODE_KEYS, *OUTPUT_PATH_KEYS)),
        "--metrics-file",
        str(folder / f"metrics{copy_suffix(copy)}.jsonl"),
        *(["--profile", str(folder / f"profile{copy_suffix(copy)}")] if profile else []),
        *(["--allow-code"] if allow_code else []),
        *(["--allow-paths"] if allow_paths else []),
    ]
    if launcher == "srun":
        srun = ["srun", f"--ntasks={ranks}", "--kill-on-bad-exit=1"]
        return [*srun, *shlex.split(srun_args), *train]
    return [*train, "--nproc-per-node", str(ranks)]


def _env(launcher: str, threads_per_rank: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if threads_per_rank:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    if launcher == "srun":
        env["FSDP2LAB_MASTER_PORT"] = str(free_port())
    return env


class Interrupted(Exception):
    """The sweep was stopped (SIGINT or SIGTERM): the running job was ended."""


def _interrupt(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def _run_job(
    cmds: list[list[str]], folder: Path, envs: list[dict], timeout_s: float | None
) -> int | str:
    """The first non-zero exit code of the job's commands (run at once), or ``"timeout"``; each
    command's whole process group is ended.

    Each command runs in a session of its own, so that its workers can be ended together; a
    signal that stops the sweep ends the job too.
    """
    procs = []
    try:
        for i, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
            out = open(folder / f"stdout{copy_suffix(i)}.log", "w")  # noqa: SIM115
            err = open(folder / f"stderr{copy_suffix(i)}.log", "w")  # noqa: SIM115
            with out, err:
                procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
                )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        codes = []
        for proc in procs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            codes.append(proc.wait(timeout=left))
        return next((c for c in codes if c), 0)
    except subprocess.TimeoutExpired:
        for proc in procs:
            _end_group(proc)
        return "timeout"
    except BaseException:
        for proc in procs:
            _end_group(proc)
        raise


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (its workers too), SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_error(folder: Path) -> str:
    lines = [ln for ln in (folder / "stderr.log").read_text(errors="replace").splitlines() if ln]
    errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_sweep(
    runs: list[RunSpec],
    out: Path,
    *,
    launcher: str,
    timeout_s: float | None = None,
    srun_args: str = "",
    resume: bool = False,
    threads_per_rank: int | None = None,
    profile: bool = False,
    allow_code: bool = False,
    allow_paths: bool = False,
) -> list[dict]:
    """Run every planned run in turn; print one line each; return their statuses."""
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        job = (out, launcher, timeout_s, srun_args, resume, threads_per_rank, profile)
        job += (allow_code, allow_paths)
        return _run_all(runs, job)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_all(runs, job) -> list[dict]:
    """One line per run on stdout; on a terminal, a bar across the runs (done, ETA) on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=len(runs), unit="run", file=sys.stderr, disable=not sys.stderr.isatty())
    try:
        return [_one_run(i, run, len(runs), bar, *job) for i, run in enumerate(runs, 1)]
    finally:
        bar.close()


def _one_run(
    i,
    run,
    n,
    bar,
    out,
    launcher,
    timeout_s,
    srun_args,
    resume,
    threads_per_rank,
    profile,
    allow_code,
    allow_paths,
) -> dict:
    from fsdp2lab.bench.results import read_metrics, step_time

    def say(line: str) -> None:
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    folder = out / run.run_id
    prefix = f"[{i:>{len(str(n))}}/{n}] {run.run_id}"
    status_file = folder / "status.json"
    bar.set_description(run.run_id)
    if resume and status_file.exists() and json.loads(status_file.read_text())["ok"]:
        say(f"{prefix}: done before, kept")
        bar.update(1)
        return json.loads(status_file.read_text())
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(run.values), encoding="utf-8")
    cmds = [
        command(run, folder, launcher, srun_args, copy, profile, allow_code, allow_paths)
        for copy in range(run.copies)
    ]
    (folder / "command.txt").write_text("".join(shlex.join(c) + "\n" for c in cmds))
    t0 = time.monotonic()
    try:
        envs = [_env(launcher, threads_per_rank) for _ in cmds]  # srun: a port each
        code = _run_job(cmds, folder, envs, timeout_s)
    except Interrupted as stop:
        say(f"{prefix} ... stopped by {stop}")
        raise
    wall = time.monotonic() - t0
    records = read_metrics(folder / "metrics.jsonl")
    ok = code == 0 and any(r["event"] == "summary" for r in records)
    status = {
        **asdict(run),
        "ok": ok,
        "returncode": code,
        "wall_s": round(wall, 3),
        "launcher": launcher,
        "device_name": device_name(),
        "error": None if ok else (_last_error(folder) or f"exit code {code}, no summary"),
    }
    status_file.write_text(json.dumps(status, indent=1) + "\n")
    if ok:
        step = step_time(records)
        note = f"ok in {wall:.1f} s, {step * 1000:.1f} ms/step" if step else f"ok in {wall:.1f} s"
    else:
        note = f"FAILED ({'timed out' if code == 'timeout' else f'exit {code}'}): {status['error']}"
    say(f"{prefix} ... {note}")
    bar.update(1)
    return status
