"""``fsdp2lab train``: standalone it resolves the run plan, then starts ``--nproc-per-node`` local
workers; under torchrun or srun it is one rank."""

from __future__ import annotations

import argparse

from fsdp2lab.cli.common import error
from fsdp2lab.config import TrainConfig, add_train_arguments, config_from_args
from fsdp2lab.errors import USAGE_EXIT_CODE, UsageError


def register(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a model (standalone, under torchrun, or one task per rank under srun)",
        description="Train a model. Standalone it starts --nproc-per-node local workers; under torchrun or "
        "srun it is one rank.",
    )
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)


def default_nproc(cfg: TrainConfig) -> int:
    import torch

    if cfg.strategy in ("single", "model-parallel"):
        return 1
    if cfg.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from fsdp2lab.plan import resolve_here
    from fsdp2lab.runtime import distributed, host_memory, launch_env, local_launcher, logs
    from fsdp2lab.runtime.worker import run_rank

    try:
        cfg = config_from_args(args)
        launch = launch_env.detect()
        logs.setup(cfg.log_level, launch.rank)
        if launch.mode == "standalone":
            nproc = cfg.nproc_per_node or default_nproc(cfg)
            plan = resolve_here(cfg, nproc)
            # Find or download the data once, before the workers start (they then find it on disk).
            from fsdp2lab.data.loader import choose

            choose(cfg, plan.spec)
            if nproc > 1:
                return local_launcher.launch(nproc, argv)
            launch = launch_env.LaunchEnv(
                "standalone", 0, 1, 0, "127.0.0.1", local_launcher.free_port()
            )
        else:
            plan = resolve_here(cfg, launch.world_size)
    except UsageError as e:
        if launch_env.detect().rank == 0:
            return error(str(e))
        return USAGE_EXIT_CODE
    if plan.device_type == "cpu":
        applied = host_memory.configure(cfg.host_malloc)
        if launch.rank == 0:
            logs.get_logger(__name__).debug(f"fsdp2lab: {applied}")
    code = run_rank(launch, cfg.device, _train_on_rank(plan), cfg.collective_timeout)
    distributed.exit_process(code)


def _train_on_rank(plan):
    def work(runtime) -> None:
        from fsdp2lab.training.session import run_training

        run_training(plan, runtime)

    return work
