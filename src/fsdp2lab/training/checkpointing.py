"""Save and resume: the checkpoint hook of the trainer.

One run per folder: rank 0 holds ``DIR/.lock`` from the start of the run to its end; a second
run on the folder is bad input, before it writes or deletes anything.

Save: rank 0 marks ``DIR/step-N`` as this tool's (``.fsdp2lab-save``: only marked folders are
ever deleted; another tool's ``step-N`` is never written into), every rank writes its own shards
with ``torch.distributed.checkpoint``; then rank 0 marks the folder ``COMPLETE``, points
``DIR/latest`` at it (a failure there is a warning) and prunes old ones (``--keep-last``, only now
that a newer one is complete). Saves run over their own gloo group with the long I/O timeout. With ``--async-checkpoint`` the state is copied to memory at once and
written by a background thread, at most one save in flight.

A save that fails (disk full, I/O error: DCP tells every rank) is reported in one line, its
unfinished folder is removed, and training goes on: the previous checkpoint stays the one
``--resume auto`` takes. If the run's last save failed, the run ends with exit code 1. Weights that
are not finite are never saved.

Resume: rank 0 picks the checkpoint (``--resume auto | never | PATH``) and checks it; every rank
loads it (DCP reshards to this run's world size, mesh and strategy) and the data position is
restored in global samples, so the run goes on from the same sample. Loading runs no code: DCP's
metadata through a restricted unpickler, other values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp2lab.checkpoint import layout
from fsdp2lab.checkpoint import state as ckpt_state
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import TrainingFailed, UsageError
from fsdp2lab.runtime import faults, logs
from fsdp2lab.runtime.distributed import Runtime, new_io_group, on_rank0
from fsdp2lab.runtime.torch_compat import SafeFileSystemReader, SafeLoadPlanner
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.nan_guard import trained_weights_finite

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


log = logs.get_logger(__name__)


def choose_resume(cfg: TrainConfig, notes: list[str]) -> layout.Checkpoint | None:
    """The checkpoint to resume from (checked), or None to start fresh. Pure file checks."""
    root = Path(cfg.ckpt_dir) if cfg.ckpt_dir else None
    ckpt = None
    if cfg.resume == "auto":
        if root is not None and layout.complete_folders(root):
            ckpt = layout.find_checkpoint(root, notes)
        elif root is not None:
            notes += [f"skipping incomplete checkpoint {p}" for p in layout.step_folders(root)]
    elif cfg.resume != "never":
        ckpt = layout.find_checkpoint(cfg.resume, notes)
    if root is not None:
        done = layout.complete_folders(root)
        newest = done[-1] if done else None
        if newest is not None and (ckpt is None or layout.step_of(newest) > ckpt.step):
            start = "a fresh start" if ckpt is None else f"step {ckpt.step}"
            raise UsageError(
                f"--ckpt-dir {root} already holds checkpoints up to {newest.name}, newer than "
                f"where this run starts ({start}); its saves would overwrite them. Resume from "
                "the newest (--resume auto), or use another --ckpt-dir"
            )
    return ckpt


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@dataclass
class _InFlight:
    future: Future
    path: Path
    info: dict
    started: float


class CheckpointManager(Hooks):
    """Saves on schedule (``--ckpt-every-steps``, each epoch end, the end) and resumes at start."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime):
        self.cfg, self.runtime = cfg, runtime
        self.root = Path(cfg.ckpt_dir) if cfg.ckpt_dir else None
        # Saves talk over their own group (background ones never interleave with training's).
        self.group = new_io_group(runtime)
        self.failed: str | None = None  # why the newest save failed
        self.in_flight: _InFlight | None = None
        self.last_saved_step: int | None = None
        self.rng_at_epoch_start: Callable[[], None] | None = None
        self.lock_file = None  # rank 0: DIR/.lock, held until close()
        if self.root is not None:
            on_rank0(self._lock)

    def _lock(self) -> None:
        if self.runtime.is_main:
            self.lock_file = layout.lock(self.root)

    def _unlock(self) -> None:
        if self.lock_file is not None:
            self.lock_file.close()  # closing releases the flock
            self.lock_file = None

    @classmethod
    def from_config(cls, cfg: TrainConfig, runtime: Runtime) -> CheckpointManager | None:
        wanted = cfg.ckpt_dir or cfg.resume not in ("auto", "never")
        return cls(cfg, runtime) if wanted else None

    # ------------------------------------------------------------------ hooks
    def before_fit(self, trainer: Trainer) -> None:
        try:
            self._before_fit(trainer)
        except BaseException:
            self._unlock()
            raise

    def _before_fit(self, trainer: Trainer) -> None:
        notes: list[str] = []
        ckpt, notes = on_rank0(lambda: (choose_resume(self.cfg, notes), notes))
        for note in notes:
            log.info(f"fsdp2lab: checkpoint: {note}")
        if ckpt is not None:
            self.load(trainer, ckpt)
        if self.root is not None:  # only once the checkpoint loaded: bad input changes nothing
            if self.runtime.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                for path in layout.remove_unfinished(self.root):
                    log.info(f"fsdp2lab: checkpoint: removed unfinished save {path}")
            _barrier()

    def epoch_started(self, trainer: Trainer) -> None:
        if self.rng_at_epoch_start is not None:
            self.rng_at_epoch_start()
            self.rng_at_epoch_start = None

    def after_step(self, trainer: Trainer) -> None:
        self._poll()
        st, cfg = trainer.state, self.cfg
        # At an epoch's or the run's end, after_epoch saves the state a moment later.
        due = bool(cfg.ckpt_every_steps) and st.step % cfg.ckpt_every_steps == 0
        if due and not (trainer.epoch_complete() or trainer.done()):
            self.save(trainer)

    def after_epoch(self, trainer: Trainer) -> None:
        self.save(trainer)

    def after_fit(self, trainer: Trainer) -> None:
        self.save(trainer)

    def close(self) -> None:
        """Wait for a background save to finish (and mark it complete); a TrainingFailed if the
        run's last save failed. Releases the folder's lock."""
        try:
            self._wait()
        finally:
            self._unlock()
        failed, self.failed = self.failed, None
        if failed:
            raise TrainingFailed(f"the run's last checkpoint was not saved: {failed}")

    # ------------------------------------------------------------------ save
    def save(self, trainer: Trainer) -> None:
        """Checkpoint the current step (a collective: every rank calls it at the same step)."""
        step = trainer.state.step
        if self.root is None or step == self.last_saved_step:
            return
        self._wait()
        trainer.settle()  # the NaN guard's verdicts up to this step first
        path = layout.step_dir(self.root, step)
        self.last_saved_step = step
        if layout.is_complete(path):
            log.info(f"fsdp2lab: checkpoint: {path} already exists; not saved again")
            return
        if not trained_weights_finite(trainer.model, trainer.device):
            if self.runtime.is_main:
                log.warning(f"fsdp2lab: checkpoint: {path} not saved: non-finite weights")
            return
        if not on_rank0(lambda: self._claim(path)):
            return
        info = ckpt_state.marker_info(trainer)
        started = time.perf_counter()
        devices = [trainer.device.index or 0] if trainer.device.type == "cuda" else []
        # Saving must not disturb the training RNG streams (a run with checkpoints == without).
        with torch.random.fork_rng(devices=devices):
            state = ckpt_state.capture(trainer)
            writer = faults.checkpoint_writer(path, self.runtime.rank, step)
            if self.cfg.async_checkpoint:
                # The state is copied to memory before async_save returns; training goes on.
                future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
                self.in_flight = _InFlight(future, path, info, started)
                return
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except (CheckpointException, OSError) as e:
                return self._failed(path, e)
        self._complete(path, info, started)

    def _claim(self, path: Path) -> bool:
        """Rank 0: mark ``path`` as this tool's save; False (and a warning) for another tool's
        ``step-N`` folder, which is left as it is."""
        if path.exists() and not layout.is_own(path):
            log.warning(
                f"fsdp2lab: warning: checkpoint {path} not saved: that folder is not fsdp2lab's "
                f"(no {layout.OWN_SAVE}), so it is left as it is"
            )
            return False
        try:
            layout.mark_own(path)
        except OSError as e:  # the save itself then most likely fails and says why
            log.warning(f"fsdp2lab: warning: checkpoint: cannot mark {path} as ours: {e}")
        return True

    def _poll(self) -> None:
        if self.in_flight is not None and self.in_flight.future.done():
            self._wait()

    def _wait(self) -> None:
        if self.in_flight is None:
            return
        flight, self.in_flight = self.in_flight, None
        try:
            flight.future.result()
        except (CheckpointException, OSError) as e:
            return self._failed(flight.path, e)
        self._complete(flight.path, flight.info, flight.started)

    def _failed(self, path: Path, error: BaseException) -> None:
        """A save failed on some rank (every rank gets here): say so once, drop its folder."""
        where = ""
        if isinstance(error, CheckpointException):
            rank, (error, _) = next(iter(error.failures.items()))
            where = f"rank {rank}: "
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        try:
            free = f" ({shutil.disk_usage(self.root).free / 1e6:.1f} MB free)"
        except OSError:
            free = ""
        self.failed = f"{path}: {where}{reason}{free}"
        if self.runtime.is_main and not layout.is_complete(path):
            # If this fails too, --resume skips the unfinished folder and the next start removes it.
            with contextlib.suppress(OSError):
                layout.remove(path)
            newest = layout.read_latest(self.root) or "none"
            log.warning(
                f"fsdp2lab: warning: checkpoint not saved: {self.failed}; training goes on, "
                f"--resume auto would take {newest}",
            )

    def _complete(self, path: Path, info: dict, started: float) -> None:
        """Rank 0, once every rank has written (DCP's last step is collective): mark, point, prune."""
        self.failed = None
        if not self.runtime.is_main:
            return
        try:
            marker = layout.mark_complete(path, info)
        except OSError as e:
            return self._failed(path, e)
        try:
            layout.set_latest(self.root, path)
        except OSError as e:  # the checkpoint is complete: --resume auto finds it without latest
            log.warning(
                f"fsdp2lab: warning: checkpoint {path} is complete, but {self.root / layout.LATEST} "
                f"was not updated: {e.strerror or e}; nothing was deleted"
            )
        size = sum(marker["files"].values())
        log.info(
            f"fsdp2lab: checkpoint saved: {path} ({size / 1e6:.2f} MB, "
            f"{time.perf_counter() - started:.2f}s)",
        )
        if self.cfg.keep_last:
            for old in layout.prune(self.root, self.cfg.keep_last):
                log.info(f"fsdp2lab: checkpoint: removed {old} (--keep-last)")

    # ------------------------------------------------------------------ resume
    def load(self, trainer: Trainer, ckpt: layout.Checkpoint) -> None:
        """Load ``ckpt`` into ``trainer`` on every rank; a UsageError if it does not fit."""
        run = ckpt_state.saved_run(ckpt)
        ckpt_state.check_base(trainer, ckpt)
        template = ckpt_state.template(trainer, ckpt)
        own = template.pop(ckpt_state.RANKS, {}).get(str(self.runtime.rank), {})
        ckpt_state.check_fits(trainer, ckpt, template)
        full = ckpt_state.OPTIM in ckpt.contents
        into_epoch = int(run.get("epoch_samples", 0))
        if full and into_epoch % trainer.plan.global_batch:
            raise UsageError(
                f"checkpoint {ckpt.path} stopped {into_epoch} samples into an epoch, which is not a "
                f"whole number of this run's global batches ({trainer.plan.global_batch}); resume with "
                f"--global-batch-size {run.get('global_batch')}"
            )
        if own:
            template[ckpt_state.RANKS] = {str(self.runtime.rank): own}
        try:
            dcp.load(
                template,
                storage_reader=SafeFileSystemReader(ckpt.path),
                planner=SafeLoadPlanner(),
            )
        except (Exception, CheckpointException) as e:
            why = layout.read_error(e)
            raise UsageError(f"checkpoint {ckpt.path} could not be read: {why}") from None
        ckpt_state.apply(trainer, template)
        if not full:
            log.info(
                f"fsdp2lab: checkpoint: loaded model weights from {ckpt.path}; optimizer, "
                "schedule and data start fresh",
            )
            return
        self._check_loader(trainer, ckpt, own, run)
        self._restore_rng(trainer, own, run)
        st = trainer.state
        log.info(
            f"fsdp2lab: checkpoint: resumed from {ckpt.path}: step {st.step}, epoch {st.epoch} "
            f"({st.epoch_samples} samples into it), {st.samples_seen} samples seen; saved by "
            f"{run.get('strategy')} on {run.get('world_size')} rank(s), mesh "
            f"{_mesh_text(run.get('mesh'))}",
        )
        self.last_saved_step = st.step

    def _check_loader(self, trainer: Trainer, ckpt: layout.Checkpoint, own: dict, run: dict):
        """The loader state a rank saved must agree with the global data position."""
        position = ckpt_state.loader_position(own, int(run.get("micro_batch_global", 1)))
        st = trainer.state
        if position is None or position == (st.epoch, st.epoch_samples):
            return
        if position[0] == st.epoch - 1 and st.epoch_samples == 0:  # that epoch had ended
            return
        raise UsageError(
            f"checkpoint {ckpt.path} is inconsistent: rank {self.runtime.rank}'s data loader "
            f"stopped at epoch {position[0]}, sample {position[1]}, but the train state says "
            f"epoch {st.epoch}, sample {st.epoch_samples}"
        )

    def _restore_rng(self, trainer: Trainer, own: dict, run: dict) -> None:
        """Per-rank RNG streams go on where they were; at another world size they are reseeded.

        Mid-epoch, the saved run had already started its epoch's data iterator (which draws
        from the RNG), so the states are put back only once this run has started its own.
        """
        same_ranks = run.get("world_size") == self.runtime.world_size and "rng_cpu" in own
        if same_ranks:
            restore = lambda: ckpt_state.restore_rng(trainer, own)  # noqa: E731
        else:
            restore = lambda: ckpt_state.reseed_rng(trainer)  # noqa: E731
            log.info(
                f"fsdp2lab: checkpoint: RNG states were saved by {run.get('world_size')} rank(s) "
                f"and do not map onto {self.runtime.world_size}: each rank's dropout RNG is "
                "reseeded from (seed, step, rank)",
            )
        if trainer.state.epoch_samples > 0:
            self.rng_at_epoch_start = restore
        else:
            restore()


def _mesh_text(mesh: dict | None) -> str:
    if not mesh:
        return "?"
    return " x ".join(f"{n}={s}" for n, s in zip(mesh["names"], mesh["shape"], strict=False))
