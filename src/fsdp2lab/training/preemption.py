"""Preemption and time limits: on SIGUSR1 or SIGTERM, finish the step, checkpoint, requeue, stop.

The signal handler only sets a flag. After each step every rank contributes its flag to an
all-reduce (MAX), since a signal reaches the ranks at slightly different times; so all ranks stop
after the same step. That all-reduce runs in the background, on a gloo group of its own, while the
next step computes, and its verdict is read after that step: a signal stops training one step
later than a blocking check would, and no step waits for it. At an epoch's (or the run's) last
step the check waits for ``after_epoch``, once the epoch's evaluation and checkpoint are done, and
blocks; a run that is finishing anyway finishes.

On a stop: the checkpoint manager saves this step (``--ckpt-dir``), and under Slurm rank 0 runs
``scontrol requeue $SLURM_JOB_ID``; the requeued job resumes with ``--resume auto``. SIGUSR1 (what
``#SBATCH --signal=USR1@120`` sends before the time limit) always requeues. SIGTERM requeues only
when ``scontrol show job`` says the time limit or a preemption ended the job: a plain ``scancel``
also sends SIGTERM, and requeueing would undo it. Then training ends cleanly (exit code 0).
Without ``--ckpt-dir`` the run stops without a checkpoint and is not requeued.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training.hooks import Hooks, StopTraining

if TYPE_CHECKING:
    from fsdp2lab.training.checkpointing import CheckpointManager
    from fsdp2lab.training.trainer import Trainer

log = logs.get_logger(__name__)


SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# `scontrol show job` of a job whose SIGTERM came from its time limit or a preemption.
_ENDED_BY_LIMIT = re.compile(r"\bJobState=(TIMEOUT|PREEMPTED)\b|\bReason=(TimeLimit|Preempted)\b")


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in (srun tasks and torchrun workers under srun inherit it)."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or None


def should_requeue(signum: int, show_job: str) -> bool:
    """USR1 asks for a requeue; SIGTERM only when the time limit or a preemption ended the job."""
    return signum == signal.SIGUSR1 or bool(_ENDED_BY_LIMIT.search(show_job))


def _scontrol(*args: str) -> tuple[int, str]:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, str(e)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def requeue(job_id: str, signum: int) -> str:
    """Requeue ``job_id`` if ``signum`` asks for it; a sentence saying what happened."""
    if signum != signal.SIGUSR1:
        _, show = _scontrol("show", "job", job_id)
        if not should_requeue(signum, show):
            return f"job {job_id} not requeued: SIGTERM without a time limit (scancel or shutdown)"
    code, out = _scontrol("requeue", job_id)
    if code != 0:
        return f"job {job_id} could not be requeued (scontrol requeue: {out or f'exit {code}'})"
    return f"job {job_id} requeued; it resumes from the checkpoint"


class Preemption(Hooks):
    """Stop cleanly on SIGUSR1/SIGTERM: checkpoint, requeue under Slurm, raise ``StopTraining``."""

    def __init__(self, runtime: Runtime, checkpoints: CheckpointManager | None):
        self.runtime = runtime
        self.checkpoints = checkpoints
        self.received = 0  # the first signal number received, 0 for none
        self.stopped = False
        # The flag travels on a CPU group of its own: no GPU synchronisation, and the background
        # all-reduce never queues behind (or ahead of) the training's collectives.
        self.group = dist.new_group(backend="gloo") if runtime.world_size > 1 else None
        # The background all-reduce and its host flag: a tensor over a NumPy array, read as the
        # array (no tensor op, and never on a GPU: the group is gloo's).
        self.pending: tuple[dist.Work, np.ndarray] | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        # Later signals (a second one, or the SIGTERM of our own requeue) change nothing.
        self.received = self.received or signum

    # ------------------------------------------------------------------ hooks
    def after_step(self, trainer: Trainer) -> None:
        if not (trainer.epoch_complete() or trainer.training_complete()):  # else after_epoch
            self._stop_if(trainer, self._agreed(wait=False))

    def after_epoch(self, trainer: Trainer) -> None:
        if not trainer.training_complete():
            self._stop_if(trainer, self._agreed(wait=True))

    # ------------------------------------------------------------------ stop
    def _agreed(self, wait: bool) -> int:
        """The largest signal number any rank had received by the previous check, then this
        check's flags sent in the background; with ``wait``, this check's own verdict (blocking).
        A collective on every rank, in the same order."""
        if self.runtime.world_size == 1:
            return self.received
        signum = 0
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            signum = int(flag[0])
            self.pending = None
        if signum:
            return signum
        flag = np.array([self.received], dtype=np.int64)
        work = dist.all_reduce(
            torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        if wait:
            work.wait()
            return int(flag[0])
        self.pending = (work, flag)
        return 0

    def _stop_if(self, trainer: Trainer, signum: int) -> None:
        """Save, requeue where asked, and end training, if ``signum`` is a signal (not 0)."""
        if not signum:
            return
        rt, step = self.runtime, trainer.state.step
        name = signal.Signals(signum).name
        self.stopped = True
        # From here the process ends by itself. Ignored (not handled) signals stay ignored during
        # interpreter shutdown too, where the SIGTERM of our own requeue would otherwise kill it.
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        ckpt = self.checkpoints
        if ckpt is None or ckpt.root is None:
            note = "no --ckpt-dir, so nothing is saved and the job is not requeued"
            log.info(f"fsdp2lab: preemption: {name} at step {step}; {note}")
            raise StopTraining(f"{name} at step {step}, without a checkpoint")
        ckpt.save(trainer)  # a no-op if this step is saved already
        ckpt.close()  # wait for a background save: the checkpoint is complete before a requeue
        job = slurm_job_id()
        if rt.is_main:
            outcome = requeue(job, signum) if job else "not under Slurm: no requeue"
            log.info(
                f"fsdp2lab: preemption: {name} after step {step}; saved in {ckpt.root}; {outcome}"
            )
        raise StopTraining(f"{name} at step {step}, checkpoint saved")
