"""``fsdp2lab ckpt export | import | info``: checkpoint tools that run in one process."""

from __future__ import annotations

import argparse

from fsdp2lab.cli.common import guarded


def register(subparsers) -> None:
    ckpt = subparsers.add_parser("ckpt", help="checkpoint tools: export, import, info")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    export = sub.add_parser(
        "export", help="write a checkpoint's model as one plain torch.save state dict"
    )
    export.add_argument("ckpt", metavar="CKPT", help="DIR/step-N, or DIR for its newest")
    export.add_argument("out", metavar="OUT.pt")
    export.set_defaults(func=guarded(cmd_export))
    imp = sub.add_parser(
        "import", help="make DIR/step-0, a checkpoint of a plain state dict, to fine-tune from"
    )
    imp.add_argument("source", metavar="IN.pt")
    imp.add_argument("root", metavar="DIR", help="a new checkpoint directory (for --ckpt-dir)")
    imp.set_defaults(func=guarded(cmd_import))
    info = sub.add_parser("info", help="what a checkpoint holds")
    info.add_argument("ckpt", metavar="CKPT", help="DIR/step-N, or DIR for its newest")
    info.set_defaults(func=guarded(cmd_info))


def cmd_export(args: argparse.Namespace) -> None:
    from fsdp2lab.checkpoint.export import export_checkpoint

    ckpt, weights = export_checkpoint(args.ckpt, args.out)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"exported {len(weights)} tensors ({size:,} bytes) of {ckpt.path} to {args.out}")


def cmd_import(args: argparse.Namespace) -> None:
    from fsdp2lab.checkpoint.export import import_state_dict

    path = import_state_dict(args.source, args.root)
    print(f"imported {args.source} as {path}; fine-tune from it with --ckpt-dir {args.root}")


def cmd_info(args: argparse.Namespace) -> None:
    from fsdp2lab.checkpoint import layout

    ckpt = layout.find_checkpoint(args.ckpt, [])
    print("\n".join(describe(ckpt)))


def describe(ckpt) -> list[str]:
    """``ckpt info`` lines: where training was, how the run was set up, and every tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    m = ckpt.marker
    lines = [
        f"checkpoint: {ckpt.path}",
        f"step: {m['step']}",
        f"epoch: {m.get('epoch')} ({m.get('epoch_samples', 0)} samples into it; "
        f"{m.get('samples_seen', 0)} samples seen)",
    ]
    if m.get("imported"):
        lines.append(f"imported from: {m.get('source')}")
    if "mesh" in m:
        pairs = zip(m["mesh"]["names"], m["mesh"]["shape"], strict=True)
        lines.append("mesh: " + " x ".join(f"{n}={s}" for n, s in pairs))
    for key in ("world_size", "strategy", "model", "optimizer", "scheduler"):
        if key in m:
            lines.append(f"{key.replace('_', ' ')}: {m[key]}")
    lines.append(f"contents: {', '.join(m['contents'])}")
    rows, total, others = [], 0, 0
    for key, entry in ckpt.metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            others += 1
            continue
        numel = 1
        for dim in entry.size:
            numel *= dim
        nbytes = numel * entry.properties.dtype.itemsize
        total += nbytes
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        rows.append(f"  {key}  {list(entry.size)}  {dtype}  {nbytes:,} bytes")
    lines.append(f"tensors: {len(rows)}, {total:,} bytes in all (and {others} other values)")
    lines += rows
    files = m.get("files", {})
    lines.append(f"files: {len(files)}, {sum(files.values()):,} bytes on disk")
    return lines
