"""``fsdp2lab data download NAME``: fetch a dataset (e.g. on a login node with internet)."""

from __future__ import annotations

import argparse

from fsdp2lab.cli.common import guarded


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    download = data_sub.add_parser(
        "download", help="download a dataset (e.g. on a login node with internet)"
    )
    download.add_argument("name", choices=["mnist", "fashion-mnist", "cifar10"])
    download.add_argument("--data-dir", default="./data")
    download.set_defaults(func=guarded(cmd_download))


def cmd_download(args: argparse.Namespace) -> int:
    from fsdp2lab.data import sources

    folder = sources.ensure(args.name, args.data_dir, allow_download=True)
    print(f"{args.name}: ready in {folder}")
    return 0
