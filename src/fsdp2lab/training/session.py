"""One training run on one rank: print the resolved config, train, and save the model if asked."""

from __future__ import annotations

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import TrainingFailed
from fsdp2lab.plan import RunPlan, resolve_here
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training import fault_drills, progress
from fsdp2lab.training.checkpointing import CheckpointManager
from fsdp2lab.training.hooks import Hooks
from fsdp2lab.training.nan_guard import NanGuard
from fsdp2lab.training.preemption import Preemption
from fsdp2lab.training.trainer import Trainer
from fsdp2lab.training.watchdog import Watchdog

log = logs.get_logger(__name__)


def observers(cfg: TrainConfig, runtime: Runtime) -> list[Hooks]:
    """The hooks that watch a run: extra evaluations and the target accuracy, TensorBoard, the
    progress bar, the profiler, the memory snapshot."""
    hooks: list[Hooks] = []
    if cfg.eval_every_steps:
        from fsdp2lab.training.periodic_eval import PeriodicEval

        hooks.append(PeriodicEval(cfg.eval_every_steps))
    if cfg.target_accuracy is not None:
        from fsdp2lab.training.target_accuracy import TargetAccuracy

        hooks.append(TargetAccuracy(cfg.target_fraction()))
    if cfg.tensorboard:
        from fsdp2lab.training.tensorboard import TensorBoardWriter

        hooks.append(TensorBoardWriter(cfg.tensorboard))
    if progress.wanted(cfg.progress, runtime.is_main):
        hooks.append(progress.ProgressBar())
    if cfg.profile:
        from fsdp2lab.training.profiler import Profiler

        hooks.append(Profiler(cfg.profile, runtime.rank, runtime.is_main, active=cfg.profile_steps))
    if cfg.memory_snapshot:
        from fsdp2lab.training.memory_snapshot import MemorySnapshot

        hooks.append(MemorySnapshot(cfg.memory_snapshot, runtime.rank))
    return hooks


def build_hooks(
    cfg: TrainConfig,
    runtime: Runtime,
    watchdog: Watchdog | None = None,
    checkpoints: CheckpointManager | None = None,
    preemption: Preemption | None = None,
    save_hf: Hooks | None = None,
) -> list[Hooks]:
    """A run's hooks in their order: the NaN guard, the watchdog, checkpoints, Hugging Face saves,
    fault drills, then the observers (they see the resumed state), preemption last."""
    hooks: list[Hooks] = [NanGuard(runtime, cfg.on_nan)]
    hooks += [hook for hook in (watchdog, checkpoints, save_hf) if hook is not None]
    if fault_drills.wanted():  # tests/test_faults.py: faults injected on purpose
        hooks.append(fault_drills.FaultDrills(runtime.rank))
    return [*hooks, *observers(cfg, runtime), *([preemption] if preemption else [])]


def run_training(plan: RunPlan | TrainConfig, runtime: Runtime) -> dict:
    if isinstance(plan, TrainConfig):
        plan = resolve_here(plan, runtime.world_size)
    log.info("fsdp2lab: resolved config\n" + plan.cfg.to_toml() + "\n")
    watchdog = Watchdog.start(runtime)  # reports a rank that stops responding
    try:
        return _train(plan, runtime, watchdog)
    finally:
        watchdog.stop()


def _train(plan: RunPlan, runtime: Runtime, watchdog: Watchdog) -> dict:
    cfg = plan.cfg
    checkpoints = CheckpointManager.from_config(cfg, runtime)  # None without checkpointing
    preemption = Preemption(runtime, checkpoints)  # USR1/TERM: checkpoint, requeue, stop
    save_hf = None
    if cfg.save_hf:
        from fsdp2lab.training.hf_saving import SaveHF

        save_hf = SaveHF(cfg, runtime)
    hooks = build_hooks(cfg, runtime, watchdog, checkpoints, preemption, save_hf)
    trainer = Trainer(plan, runtime, hooks=hooks)
    try:
        summary = trainer.fit()
    except TrainingFailed:
        if checkpoints:
            checkpoints.close()  # a background save of an earlier, good step completes
        raise
    if checkpoints:
        checkpoints.close()  # waits for a background save
    if save_hf:
        save_hf.check()
    if cfg.save_model and not preemption.stopped:  # a preempted run saves when it finishes
        from fsdp2lab.checkpoint.export import save_full_model

        save_full_model(trainer.model, cfg.save_model, runtime)
        log.info(f"fsdp2lab: model saved to {cfg.save_model}")
    return summary
