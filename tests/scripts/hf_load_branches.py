"""Run under torchrun: read a safetensors folder into an FSDP2-sharded model by each reader.

    hf_load_branches.py FOLDER OUT_DIR

The model (a tied embedding and head, a linear layer of 5 rows: uneven shards on 2 ranks) is
built on meta, sharded, materialised, then read by safetensors' get_slice and, where this torch's
HuggingFaceStorageReader reads slices, by DCP; each rank writes, per reader, whether every
gathered tensor equals the file's (as fp32) to OUT_DIR/<reader>.rank<R>.json.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp2lab.models.hf_weights import WeightIndex
from fsdp2lab.models.materialize import to_empty
from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.torch_compat import hf_storage_reader


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.proj = nn.Linear(4, 5)
        self.back = nn.Linear(5, 4, bias=False)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expected = load_file(folder / "model.safetensors")
    index = WeightIndex.read(folder)
    reader = hf_storage_reader()
    for branch in ("slices", "dcp") if reader is not None else ("slices",):
        with torch.device("meta"):
            reference = Tiny()
        model = Tiny()
        model.load_state_dict(reference.state_dict(), assign=True)
        model.head.weight = model.embed.weight
        for unit in (model.proj, model.back):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        to_empty(model, "cpu")
        targets = index.targets(model, reference)
        with torch.no_grad():
            if branch == "dcp":
                index.read_with_dcp(targets, reader)
            else:
                index.read_slices(targets)
        report = {}
        for name, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            report[name] = bool(torch.equal(full, expected[name].float()))
        report["tied"] = model.head.weight is model.embed.weight
        (out / f"{branch}.rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    distributed.exit_process(0)


if __name__ == "__main__":
    main()
