"""FLOPs of one real training step on each rank (gloo, CPU): the trainer's :class:`Trainer` built
from train flags, one ``Trainer.train_step`` under torch's ``FlopCounterMode`` with
:class:`fsdp2lab.scale.simulate.LocalFlopCounter` above it, so the counter sees the local ops each
rank runs (a DTensor op at its shards' shapes). Several runs, one after another in the same ranks:
rank 0 prints one JSON line, ``{"flops": [[...], ...]}``, a list per run with one entry a rank.

torchrun --nproc-per-node N tests/scripts/step_flops.py '[[TRAIN_FLAGS...], ...]'
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.runtime.distributed import Runtime, exit_process, pick_device
from fsdp2lab.scale.simulate import LocalFlopCounter
from fsdp2lab.training.trainer import Trainer


def step_flops(flags: list[str], runtime: Runtime) -> list[int]:
    """Each rank's FLOPs in one training step of ``fsdp2lab train FLAGS``."""
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    trainer = Trainer(cfg, runtime)
    batches = iter(trainer.loader)
    with FlopCounterMode(display=False) as counter, LocalFlopCounter(counter):
        trainer.train_step(batches)
    flops: list = [None] * runtime.world_size
    dist.all_gather_object(flops, counter.get_total_flops())
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
