"""``fsdp2lab data download NAME``: fetch a dataset (e.g. on a login node with internet).
``fsdp2lab data prepare``: tokenize your text into a token file (``--dataset tokens:DIR``)."""

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
    prepare = data_sub.add_parser(
        "prepare",
        help="tokenize text, JSON lines or parquet files into a token file (--dataset tokens:DIR)",
    )
    prepare.add_argument("--tokenizer", required=True, help="a tokenizer folder (tokenizer.json)")
    prepare.add_argument(
        "--input",
        required=True,
        nargs="+",
        metavar="FILE",
        help="text files (a document each), .jsonl (a document per line), .parquet (per row)",
    )
    prepare.add_argument("--out", required=True, metavar="DIR", help="where the token file goes")
    prepare.add_argument("--field", default="text", help="JSON lines and parquet: the text field")
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="the share of the tokens held out for evaluation (the last ones; default: 0.01)",
    )
    prepare.add_argument(
        "--eos", help="the token that ends a document (default: the tokenizer's EOS token)"
    )
    prepare.add_argument(
        "--progress", choices=("on", "off"), default="on", help="progress bar (default: on)"
    )
    prepare.set_defaults(func=guarded(cmd_prepare))


def cmd_download(args: argparse.Namespace) -> int:
    from fsdp2lab.data import sources

    folder = sources.ensure(args.name, args.data_dir, allow_download=True)
    print(f"{args.name}: ready in {folder}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from fsdp2lab.data import tokens

    tokenizer = tokens.Tokenizer.load(args.tokenizer, args.eos)
    header = tokens.prepare(
        tokenizer,
        args.input,
        args.out,
        field=args.field,
        val_fraction=args.val_fraction,
        progress=args.progress == "on",
    )
    print(
        f"{args.out}: {header['train_tokens']:,} training and {header['val_tokens']:,} held-out "
        f"tokens ({header['dtype']}) of {header['documents']:,} documents; vocabulary "
        f"{header['vocab_size']:,}, EOS id {header['eos_id']}"
    )
    return 0
