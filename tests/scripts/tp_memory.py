"""Memory of one real training step on rank 0 (gloo, CPU), by category: the trainer's
:class:`Trainer` built from train flags, one warm-up ``Trainer.train_step`` (the optimizer state
made), then one more under torch's ``FSDPMemTracker``, as ``fsdp2lab plan`` tracks its simulated
step (:func:`fsdp2lab.scale.simulate.track`). Rank 0 prints one JSON line: ``{"peak_bytes": ...,
"by_category": {"activations": ..., "temporaries": ..., ...}}`` at the step's peak.

``--loss-chunk-bytes B`` (first) sets the loss's chunk (``training.loss.CHUNK_BYTES``): a tiny
model's logits then span many chunks, as a real model's do (a 128,256-token vocabulary's 64 MiB
chunk is 130 tokens).

torchrun --nproc-per-node N tests/scripts/tp_memory.py [--loss-chunk-bytes B] TRAIN_FLAGS...
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.runtime.distributed import Runtime, exit_process, pick_device
from fsdp2lab.scale.simulate import _peak
from fsdp2lab.training import loss
from fsdp2lab.training.trainer import Trainer


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--loss-chunk-bytes"]:
        loss.CHUNK_BYTES, args = int(args[1]), args[2:]
    cfg = config_from_args(build_parser().parse_args(["train", *args]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    runtime = Runtime(rank, world, local_rank, pick_device("cpu", local_rank), "gloo")
    trainer = Trainer(cfg, runtime)
    batches = iter(trainer.loader)
    trainer.train_step(batches)
    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    with tracker:
        trainer.train_step(batches)
    peak, by_category = _peak(tracker)
    if rank == 0:
        print(json.dumps({"peak_bytes": peak, "by_category": by_category}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
