"""Run under torchrun: NF4 weights quantized shard by shard (``--quantize-base nf4`` on FSDP2).

    torchrun --nproc-per-node N tests/scripts/qlora_sharded.py FOLDER OUT_DIR [--dp-replicate R]

Each rank writes OUT_DIR/rank<R>.json with:

* ``random``: per dtype, whether ``nf4.quantize_into`` of this rank's rows of a random weight
  (rows of growing scale, so the shards' own scale means differ) equals the same shard of torchao's
  ``to_nf4`` of the whole weight, inner tensor by inner tensor, bit for bit; and, the negative
  control, whether ``to_nf4`` of the rows alone (their own mean) does.
* ``read``: the bytes this rank read of each quantized weight (safetensors' ``get_slice``, every
  read counted; DCP off, so that every tensor is read that way) and the weight's whole bytes in
  the files, while ``build_model`` builds an ``hf:FOLDER`` QLoRA model.
* ``loaded``: per quantized weight, whether its NF4 shard equals that shard of ``to_nf4`` of the
  file's whole weight, bit for bit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from fsdp2lab.config import TrainConfig
from fsdp2lab.models import hf_weights, nf4, quantize
from fsdp2lab.models.hf_weights import base_key
from fsdp2lab.parallel.strategies import build_model
from fsdp2lab.plan import resolve
from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.mesh import build_mesh, dp_mesh
from fsdp2lab.runtime.torch_compat import local_shape_and_offset, local_tensor, torchao_nf4

NF4Tensor, to_nf4 = torchao_nf4()
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def same(a, b) -> bool:
    return a.n_blocks == b.n_blocks and all(
        torch.equal(getattr(a, n), getattr(b, n)) for n in INNER
    )


def shard_of_whole(target, whole: torch.Tensor):
    """The shard of ``to_nf4(whole)`` (torchao's split by rows) that DTensor ``target`` holds."""
    (rows, _), (first, _) = local_shape_and_offset(target)
    shards = to_nf4(whole, quantize.BLOCK, quantize.SCALER_BLOCK).split(rows)
    return shards[first // rows]


def random_weights(mesh) -> dict:
    """quantize_into against to_nf4 of the whole weight, and the shard's own mean (the control)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        generator = torch.Generator().manual_seed(0)
        rows = torch.linspace(0.01, 1.0, 512).unsqueeze(1)
        whole = (torch.randn(512, 256, generator=generator) * rows).to(dtype)
        layer = nn.Linear(256, 512, bias=False, device="meta")
        meta = to_nf4(whole.to("meta"), quantize.BLOCK, quantize.SCALER_BLOCK)
        layer.weight = nn.Parameter(meta, requires_grad=False)
        fully_shard(layer, mesh=mesh).to_empty(device="cpu")
        target = layer.weight
        rows_here = distribute_tensor(whole, mesh, target.placements, src_data_rank=None).to_local()
        nf4.quantize_into(target, rows_here)
        reference = shard_of_whole(target, whole)
        own = to_nf4(rows_here, quantize.BLOCK, quantize.SCALER_BLOCK)
        out[str(dtype)] = {
            "equal": same(local_tensor(target), reference),
            "own_mean_equal": all(
                torch.equal(getattr(own, n), getattr(reference, n)) for n in INNER
            ),
        }
    return out


class CountedReads:
    """``safetensors.safe_open`` whose ``get_slice(key)[...]`` reads add their bytes to ``read``."""

    def __init__(self, opened, read: dict[str, int]):
        self.opened, self.read = opened, read

    def __enter__(self):
        self.opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)

    def keys(self):
        return self.opened.keys()

    def get_tensor(self, key):
        tensor = self.opened.get_tensor(key)
        self.read[key] = self.read.get(key, 0) + tensor.nbytes
        return tensor

    def get_slice(self, key):
        part = self.opened.get_slice(key)
        read = self.read

        class Counted:
            def __getattr__(self, name):
                return getattr(part, name)

            def __getitem__(self, index):
                tensor = part[index]
                read[key] = read.get(key, 0) + tensor.nbytes
                return tensor

        return Counted()


def qlora_plan(folder: Path, replicate: int):
    world = dist.get_world_size()
    cfg = TrainConfig(model=f"hf:{folder}", dataset="synthetic", lora_rank=4,
                      quantize_base="nf4", mixed_precision="bf16", dp_replicate=replicate,
                      seq_len=16, global_batch_size=world * 2)  # fmt: skip
    return resolve(cfg, world, "cpu")


def load_hf(folder: Path, plan, mesh) -> tuple[dict, dict]:
    read: dict[str, int] = {}
    opener = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: CountedReads(opener(*a, **k), read)
    hf_weights.hf_storage_reader = lambda: None  # every tensor through get_slice
    try:
        model = build_model(plan, mesh, torch.device("cpu"))
    finally:
        safetensors.safe_open = opener
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        files.update(load_file(path))
    quantized, loaded = {}, {}
    for name, param in model.named_parameters():
        if not isinstance(local_tensor(param), NF4Tensor):
            continue
        key = base_key(name)
        whole = files[key].to(param.dtype)
        quantized[key] = {"read": read.get(key, 0), "whole": files[key].nbytes}
        loaded[key] = same(local_tensor(param), shard_of_whole(param, whole))
    return quantized, loaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dp-replicate", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    plan = qlora_plan(args.folder, args.dp_replicate)
    mesh = build_mesh(plan.dims, "cpu")
    report = {"random": random_weights(dp_mesh(mesh))}  # HSDP: (dp_replicate, dp_shard)
    report["read"], report["loaded"] = load_hf(args.folder, plan, mesh)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    distributed.exit_process(0)


if __name__ == "__main__":
    main()
