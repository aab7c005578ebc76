"""FLOPs of one real training step on each rank (gloo, CPU): the trainer's :class:`Trainer` built
from train flags, one ``Trainer.train_step`` under :class:`LocalFlops`, which counts with
torch's own FLOP formulas (``torch.utils.flop_counter``'s, as ``FlopCounterMode`` does) the ops
each rank's kernels run: an op on DTensors is left to DTensor's dispatch (``NotImplemented``),
which runs it on the local shards with this mode still on the stack; an op on fake tensors
(DTensor inferring an output's global shape) runs no kernel and counts nothing. Nothing of
``fsdp2lab plan``'s counting is used. Several runs, one after another in the same ranks: rank 0
prints one JSON line, ``{"flops": [[...], ...]}``, a list per run with one entry a rank.

torchrun --nproc-per-node N tests/scripts/step_flops.py '[[TRAIN_FLAGS...], ...]'
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.runtime.distributed import Runtime, exit_process, pick_device
from fsdp2lab.training.trainer import Trainer

# torch's formulas; addmm_ (the fused LoRA adapter's) as addmm
FORMULAS = {**flop_registry, torch.ops.aten.addmm_: flop_registry[torch.ops.aten.addmm]}


class LocalFlops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        formula = FORMULAS.get(func._overloadpacket)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if formula is not None and not any(isinstance(t, FakeTensor) for t in tensors):
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def step_flops(flags: list[str], runtime: Runtime) -> list[int]:
    """Each rank's FLOPs in one training step of ``fsdp2lab train FLAGS``."""
    trainer = Trainer(config_from_args(build_parser().parse_args(["train", *flags])), runtime)
    batches = iter(trainer.loader)
    with LocalFlops() as counter:
        trainer.train_step(batches)
    flops: list = [None] * runtime.world_size
    dist.all_gather_object(flops, counter.flops)
    return flops


def main() -> None:
    runs = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    runtime = Runtime(rank, world, local_rank, pick_device("cpu", local_rank), "gloo")
    flops = [step_flops(flags, runtime) for flags in runs]
    if rank == 0:
        print(json.dumps({"flops": flops}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
