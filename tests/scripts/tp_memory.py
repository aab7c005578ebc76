"""Memory of one real training step on rank 0 (gloo, CPU), by category, at each of several TP
degrees in one launch: for each, the trainer's :class:`Trainer` built from train flags and
``--tp k``, one warm-up ``Trainer.train_step`` (the optimizer state made), then one more under
torch's ``FSDPMemTracker``, as ``fsdp2lab plan`` tracks its simulated step
(:func:`fsdp2lab.scale.simulate.track`). Rank 0 prints one JSON line: ``{"k": {"peak_bytes": ...,
"by_category": {"activations": ..., "temporaries": ..., ...}}, ...}`` at each step's peak.

``--loss-chunk-bytes B`` (first) sets the loss's chunk (``training.loss.CHUNK_BYTES``): a tiny
model's logits then span many chunks, as a real model's do (a 128,256-token vocabulary's 64 MiB
chunk is 130 tokens).

torchrun --nproc-per-node N tests/scripts/tp_memory.py [--loss-chunk-bytes B] --tp-degrees 1,2,4 \
    TRAIN_FLAGS...
"""

from __future__ import annotations

import gc
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


def measure(args: list[str], runtime: Runtime) -> dict:
    """One tracked steady step of the trainer built from ``args``: its peak and categories."""
    trainer = Trainer(config_from_args(build_parser().parse_args(["train", *args])), runtime)
    batches = iter(trainer.loader)
    trainer.train_step(batches)
    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    with tracker:
        trainer.train_step(batches)
    peak, by_category = _peak(tracker)
    return {"peak_bytes": peak, "by_category": by_category}


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--loss-chunk-bytes"]:
        loss.CHUNK_BYTES, args = int(args[1]), args[2:]
    if args[:1] != ["--tp-degrees"]:
        sys.exit("usage: tp_memory.py [--loss-chunk-bytes B] --tp-degrees K,... TRAIN_FLAGS...")
    degrees, args = [int(k) for k in args[1].split(",")], args[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    runtime = Runtime(rank, world, local_rank, pick_device("cpu", local_rank), "gloo")
    results = {}
    for k in degrees:
        results[k] = measure([*args, *(["--tp", str(k)] if k > 1 else [])], runtime)
        gc.collect()  # the last trainer's tensors, before the next is tracked
        dist.barrier()
    if rank == 0:
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
