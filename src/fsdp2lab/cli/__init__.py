"""The ``fsdp2lab`` command: one module per command (train, data, ckpt, bench/report, plan)."""

from __future__ import annotations

import argparse
import sys

from fsdp2lab.cli import bench, ckpt, data, plan, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp2lab",
        description="Train PyTorch models with FSDP2 on a DeviceMesh, from a laptop CPU to Slurm.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (train, data, ckpt, bench, plan):
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.func(args, argv)
