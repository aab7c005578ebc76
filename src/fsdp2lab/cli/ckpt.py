"""``fsdp2lab ckpt export | import | info``: checkpoint tools that run in one process."""

from __future__ import annotations

import argparse
import json
import os

from fsdp2lab.cli.common import guarded
from fsdp2lab.config import PRECISIONS
from fsdp2lab.errors import UsageError


def register(subparsers) -> None:
    ckpt = subparsers.add_parser("ckpt", help="checkpoint tools: export, import, info")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as a torch.save state dict or as safetensors",
        description="OUT.pt: one torch.save state dict. --format safetensors: OUT.safetensors is "
        "one file; any other OUT is a folder in Hugging Face's save_pretrained layout "
        "(model.safetensors or shards and their index; config.json with --hf-config, or from a "
        "Hugging Face model's run, which records its config: then a plain OUT is such a folder). "
        "Safetensors are written one tensor at a time: the model is never held whole. A LoRA "
        "run's checkpoint (--lora-rank) to a folder: a PEFT adapter folder "
        "(adapter_config.json, adapter_model.safetensors), or with --merge the base model with "
        "the adapters merged in. Safetensors hold the source model's dtype (the one its Hugging "
        'Face config names; --save-dtype chooses) and the metadata {"format": "pt"}.',
    )
    export.add_argument("ckpt", metavar="CKPT", help="DIR/step-N, or DIR for its newest")
    export.add_argument("out", metavar="OUT", help="OUT.pt, OUT.safetensors, or a folder")
    export.add_argument(
        "--format",
        choices=["torch", "safetensors"],
        default=None,
        help="default: safetensors for OUT.safetensors, an existing folder or --hf-config; "
        "else torch",
    )
    export.add_argument(
        "--hf-config",
        metavar="CONFIG.json",
        default=None,
        help="the model's Hugging Face config: written as OUT/config.json, tied weights stored "
        "once, so that AutoModelForCausalLM.from_pretrained(OUT) loads it (needs the hf extra)",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="folder layout: shards of at most SIZE (5GB, 500MB, 2GiB); default 5GB",
    )
    export.add_argument(
        "--save-dtype",
        choices=PRECISIONS,
        default=None,
        help="safetensors: the dtype of floating tensors (default: the source model's, as the "
        "Hugging Face config names it, else as trained; a LoRA run's adapters: as trained)",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run's checkpoint: the base model with the adapters merged in, as a "
        "save_pretrained folder in the source model's dtype (default: a PEFT adapter folder)",
    )
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


def _export_format(args: argparse.Namespace) -> str:
    if args.format is not None:
        if args.format == "torch" and args.hf_config:
            raise UsageError("--hf-config goes with --format safetensors")
        return args.format
    if args.hf_config or args.out.endswith(".safetensors") or os.path.isdir(args.out):
        return "safetensors"
    if not args.out.endswith((".pt", ".pth")) and _recorded_hf_config(args.ckpt):
        return "safetensors"  # a Hugging Face model's run: its save_pretrained folder
    return "torch"


def _recorded_hf_config(ckpt: str) -> bool:
    from fsdp2lab.checkpoint import layout
    from fsdp2lab.checkpoint.state import saved_run

    return bool(saved_run(layout.find_checkpoint(ckpt, [])).get("hf_config"))


def _read_hf_config(path: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--hf-config {path} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--hf-config {path} is not a JSON object")
    return config


def cmd_export(args: argparse.Namespace) -> None:
    if _lora_folder_export(args):
        return
    if _export_format(args) == "safetensors":
        from fsdp2lab.checkpoint.safetensors_export import export_safetensors
        from fsdp2lab.config import parse_size

        hf_config = _read_hf_config(args.hf_config) if args.hf_config else None
        size = parse_size(args.max_shard_size)
        done = export_safetensors(args.ckpt, args.out, hf_config, size, args.save_dtype)
        tied = f"; {len(done.tied)} tied weights stored once" if done.tied else ""
        print(
            f"exported {done.tensors} tensors ({done.total_bytes:,} bytes) of {done.ckpt.path} "
            f"to {args.out} as safetensors ({len(done.files)} files{tied})"
        )
        return
    if args.save_dtype:
        raise UsageError("--save-dtype goes with safetensors (OUT.safetensors or a folder)")
    from fsdp2lab.checkpoint.export import export_checkpoint

    ckpt, weights = export_checkpoint(args.ckpt, args.out)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"exported {len(weights)} tensors ({size:,} bytes) of {ckpt.path} to {args.out}")


def _lora_folder_export(args: argparse.Namespace) -> bool:
    """A LoRA run's checkpoint to a folder: a PEFT adapter folder, or with ``--merge`` the merged
    model. False for any other export (a LoRA run's adapters alone go to OUT.pt or
    OUT.safetensors as any checkpoint's model does)."""
    from fsdp2lab.checkpoint import layout
    from fsdp2lab.checkpoint.lora_export import export_adapter, export_merged, is_lora

    lora = is_lora(layout.find_checkpoint(args.ckpt, []))
    if args.merge and not lora:
        raise UsageError(f"--merge: {args.ckpt} is not a LoRA run's checkpoint (--lora-rank)")
    if not lora or args.out.endswith((".pt", ".pth", ".safetensors")) or args.format == "torch":
        if args.merge:
            raise UsageError("--merge writes a folder: give a folder name for OUT")
        return False
    if args.hf_config:
        raise UsageError("--hf-config: a LoRA run's export takes the config its run recorded")
    if args.merge:
        from fsdp2lab.config import parse_size

        done = export_merged(args.ckpt, args.out, parse_size(args.max_shard_size), args.save_dtype)
        what = "the base model with the adapters merged in, as safetensors"
    else:
        done = export_adapter(args.ckpt, args.out, args.save_dtype)
        what = "a PEFT adapter folder"
    print(
        f"exported {done.tensors} tensors ({done.total_bytes:,} bytes) of {done.ckpt.path} to "
        f"{args.out} as {what} ({len(done.files)} files)"
    )
    return True


def cmd_import(args: argparse.Namespace) -> None:
    from fsdp2lab.checkpoint.export import import_state_dict

    path = import_state_dict(args.source, args.root)
    print(f"imported {args.source} as {path}; fine-tune from it with --ckpt-dir {args.root}")


def cmd_info(args: argparse.Namespace) -> None:
    from fsdp2lab.checkpoint import layout

    ckpt = layout.find_checkpoint(args.ckpt, [])
    try:
        lines = describe(ckpt)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(
            f"checkpoint {ckpt.path}: its {layout.COMPLETE} mark is damaged ({type(e).__name__}: "
            f"{e})"
        ) from None
    print("\n".join(lines))


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
