"""``fsdp2lab plan``: per-GPU memory, communication and speed of a training run at any scale,
predicted on this machine (no GPU): the ``train`` flags plus the cluster's size and GPU."""

from __future__ import annotations

import argparse
import json

from fsdp2lab.cli.common import guarded
from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.errors import UsageError


def register(subparsers) -> None:
    from fsdp2lab.scale import estimate, gpus

    p = subparsers.add_parser(
        "plan",
        help="predict per-GPU memory, communication and speed at any scale, without the GPUs",
        description="Predict a training run's per-GPU memory, communication and step time on N "
        "GPUs by running its parallelize code and steps on fake tensors over a fake process group. "
        "Takes every train flag.",
    )
    add_train_arguments(p)
    p.add_argument("--world-size", type=int, help="GPUs in all (or --nnodes x --nproc-per-node)")
    p.add_argument("--nnodes", type=int, help="nodes (GPUs per node: --nproc-per-node, default 8)")
    p.add_argument("--gpu", default="h100", help=f"one of {', '.join(gpus.GPUS)} (default: h100)")
    p.add_argument(
        "--inter-node-gbs",
        type=float,
        default=gpus.DEFAULT_INTER_NODE_GBS,
        help="bandwidth between nodes per GPU, GB/s per direction (default: %(default)s, one "
        "400 Gb/s NIC per GPU)",
    )
    p.add_argument(
        "--memory-margin",
        type=float,
        default=estimate.DEFAULT_MARGIN,
        help="fraction of the GPU's memory to keep free (default: %(default)s)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="search the layouts (HSDP/FSDP degrees, --tp, --pp and its schedule, AC, units, "
        "resharding, gradient accumulation) of --global-batch-size on these GPUs, and print the "
        "fastest five that fit, each with its train flags (a searched flag given is kept)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=guarded(cmd_plan))


def world_size(args: argparse.Namespace, nproc: int) -> int:
    if args.world_size is not None and args.nnodes and args.world_size != args.nnodes * nproc:
        raise UsageError(
            f"--world-size {args.world_size} disagrees with --nnodes {args.nnodes} x "
            f"--nproc-per-node {nproc}; give one of them"
        )
    size = args.world_size or (args.nnodes * nproc if args.nnodes else None)
    if not size or size < 1:
        raise UsageError("fsdp2lab plan needs --world-size N (or --nnodes N [--nproc-per-node G])")
    return size


def cmd_plan(args: argparse.Namespace) -> int:
    from fsdp2lab.scale.estimate import Hardware
    from fsdp2lab.scale.gpus import get_gpu
    from fsdp2lab.scale.report import format_report, plan_report

    cfg = config_from_args(args)
    nproc = cfg.nproc_per_node or 8
    if not 0 <= args.memory_margin < 1 or args.inter_node_gbs <= 0:
        raise UsageError("--memory-margin must be in [0, 1), --inter-node-gbs > 0")
    hw = Hardware(get_gpu(args.gpu), nproc, args.inter_node_gbs, args.memory_margin)
    if args.search:
        if cfg.quantize_base:
            raise UsageError(
                "fsdp2lab plan --search does not search --quantize-base layouts yet: plan one "
                "layout (fsdp2 or HSDP, the AC and units you choose) without --search"
            )
        from fsdp2lab.scale.search import SEARCHED, format_search, search

        given = [name for name in SEARCHED if getattr(args, name, None) is not None]
        found = search(cfg, world_size(args, nproc), hw, given)
        print(json.dumps(found, indent=1) if args.json else format_search(found))
        return 0
    report = plan_report(cfg, world_size(args, nproc), hw)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
