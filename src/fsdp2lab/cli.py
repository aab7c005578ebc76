"""The ``fsdp2lab`` command: ``train``, ``data``, and the tools the other modules register."""

from __future__ import annotations

import argparse
import os
import sys

from fsdp2lab.config import TrainConfig, add_train_arguments, config_from_args
from fsdp2lab.errors import USAGE_EXIT_CODE, UsageError


def _error(message: str) -> int:
    print(f"fsdp2lab: error: {message}", file=sys.stderr, flush=True)
    return USAGE_EXIT_CODE


# ---------------------------------------------------------------------------- train
def default_nproc(cfg: TrainConfig) -> int:
    import torch

    if cfg.strategy in ("single", "model-parallel"):
        return 1
    if cfg.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def preflight(cfg: TrainConfig, world_size: int) -> None:
    """Checks of the flags against the world size, done before any worker starts."""
    from fsdp2lab.data.loader import batch_sizes
    from fsdp2lab.models import get_spec
    from fsdp2lab.models.materialize import build_on_meta
    from fsdp2lab.parallel.strategies import check_world_size, get_strategy, validate
    from fsdp2lab.runtime.mesh import ParallelDims

    if cfg.memory_snapshot:
        from fsdp2lab.training.memory_snapshot import check_available

        check_available(cfg.device)
    spec = get_spec(cfg.model)
    check_world_size(get_strategy(cfg.strategy), world_size)
    validate(cfg, world_size)
    dims = ParallelDims.resolve(world_size, cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp)
    batch_sizes(cfg, dims.dp)
    if cfg.dataset not in ("auto",) and cfg.dataset not in spec.datasets:
        raise UsageError(
            f"dataset {cfg.dataset!r} does not fit model {spec.name!r}; it takes: {', '.join(spec.datasets)}"
        )
    build_on_meta(lambda: spec.build(cfg))  # the model's own size checks, at no memory cost
    if cfg.ckpt_dir:
        from fsdp2lab.checkpoint.layout import check_writable

        check_writable(cfg.ckpt_dir)


def train_on_rank(cfg: TrainConfig):
    def work(runtime) -> None:
        from fsdp2lab.training.session import run_training

        run_training(cfg, runtime)

    return work


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from fsdp2lab.runtime import launch_env, local_launcher, logs
    from fsdp2lab.runtime.worker import run_rank

    try:
        cfg = config_from_args(args)
        launch = launch_env.detect()
        logs.setup(cfg.log_level, launch.rank)
        if launch.mode == "standalone":
            nproc = cfg.nproc_per_node or default_nproc(cfg)
            preflight(cfg, nproc)
            # Find or download the data once, before the workers start (they then find it on disk).
            from fsdp2lab.data.loader import choose
            from fsdp2lab.models import get_spec

            choose(cfg, get_spec(cfg.model))
            if nproc > 1:
                return local_launcher.launch(nproc, argv)
            launch = launch_env.LaunchEnv(
                "standalone", 0, 1, 0, "127.0.0.1", local_launcher.free_port()
            )
        else:
            preflight(cfg, launch.world_size)
    except UsageError as e:
        if launch_env.detect().rank == 0:
            return _error(str(e))
        return USAGE_EXIT_CODE
    code = run_rank(launch, cfg.device, train_on_rank(cfg), cfg.collective_timeout)
    _exit_worker(code)


def _exit_worker(code: int) -> None:
    """End a rank without interpreter teardown: gloo's background threads can abort a normal exit
    ("terminate called without an active exception") after the process group is destroyed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------- data
def cmd_data(args: argparse.Namespace, argv: list[str]) -> int:
    from fsdp2lab.data import sources

    try:
        folder = sources.ensure(args.name, args.data_dir, allow_download=True)
    except UsageError as e:
        return _error(str(e))
    print(f"{args.name}: ready in {folder}")
    return 0


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp2lab",
        description="Train PyTorch models with FSDP2 on a DeviceMesh, from a laptop CPU to Slurm.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a model (standalone, under torchrun, or one task per rank under srun)",
        description="Train a model. Standalone it starts --nproc-per-node local workers; under torchrun or "
        "srun it is one rank.",
    )
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)

    data = sub.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    download = data_sub.add_parser(
        "download", help="download a dataset (e.g. on a login node with internet)"
    )
    download.add_argument("name", choices=["mnist", "fashion-mnist", "cifar10"])
    download.add_argument("--data-dir", default="./data")
    download.set_defaults(func=cmd_data)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """``register(subparsers)`` functions of the command groups that live with their features."""
    from fsdp2lab.bench import commands as bench_commands
    from fsdp2lab.checkpoint import commands as checkpoint_commands

    return [checkpoint_commands.register, bench_commands.register]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, argv)
