"""Memory of one real training step on rank 0 (gloo, CPU), at each of several TP degrees in one
launch: for each, the trainer's :class:`Trainer` built from train flags and ``--tp k``, one
warm-up ``Trainer.train_step`` (the optimizer state made), then one more under torch's profiler,
which records each allocation and free of the CPU allocator (``profile_memory``). Nothing of
``fsdp2lab plan``'s tracking is used: the blocks the training thread allocates in the step (those
gloo's threads allocate for themselves left out) are summed into a running total, and at its
highest each block still live counts by when it was allocated:

- ``activations``: before backward (forward and the loss);
- ``temporaries``: from backward's first autograd function on;

both outside FSDP2's ranges (``FSDP::...``: its gathered parameters and buffers) and c10d's calls
(``c10d::...``: gloo's staging copies of a collective's input, which its threads free, unrecorded).
A block whose free the profiler did not record counts as freed when the allocator hands its
address out again. Each wait of a collective (FSDP2's ``Work.wait``, DTensor's functional ones) is
followed by a short pause, so that gloo's threads let go of its tensors at the same point of the
step, run after run. Rank 0 prints one JSON line: ``{"k": {"by_category": {"activations": ...,
"temporaries": ...}}, ...}``.

``--loss-chunk-bytes B`` (first) sets the loss's chunk (``training.loss.CHUNK_BYTES``): a tiny
model's logits then span many chunks, as a real model's do (a 128,256-token vocabulary's 256 MiB
chunk is 523 tokens).

torchrun --nproc-per-node N tests/scripts/tp_memory.py [--loss-chunk-bytes B] --tp-degrees 1,2,4 \
    TRAIN_FLAGS...
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from scale_measure import SETTLE_S, settle_after_wait
from torch.profiler import ProfilerActivity, profile, record_function

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.runtime.distributed import Runtime, exit_process, pick_device
from fsdp2lab.training import loss
from fsdp2lab.training.trainer import Trainer

STEP = "measured step"


def settle_after_functional_wait() -> None:
    """Follow each wait of a functional collective (DTensor's) with a pause of ``SETTLE_S``, in
    which gloo's worker thread lets go of the collective's tensors, as ``settle_after_wait`` does
    for ``Work.wait``: their frees then come at the same point of the step, run after run."""
    wait = funcol.wait_tensor

    def wait_and_settle(tensor):
        out = wait(tensor)
        time.sleep(SETTLE_S)
        return out

    funcol.wait_tensor = wait_and_settle


def measure(args: list[str], runtime: Runtime) -> dict:
    """One profiled steady step of the trainer built from ``args``: its categories at its peak."""
    trainer = Trainer(config_from_args(build_parser().parse_args(["train", *args])), runtime)
    batches = iter(trainer.loader)
    trainer.train_step(batches)
    dist.barrier()
    with (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
        record_function(STEP),
    ):
        trainer.train_step(batches)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return {"by_category": at_peak(events)}


def at_peak(events: list[dict]) -> dict[str, int]:
    """The live bytes of each kind of block (the docstring's) at the step's highest total."""
    (step,) = [e for e in events if e.get("ph") == "X" and e.get("name") == STEP]
    tid, start = step["tid"], step["ts"]
    ranges = [e for e in events if e.get("ph") == "X" and e["tid"] == tid and e["ts"] >= start]
    fsdp = [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"].startswith("FSDP::")]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"].startswith("c10d::")]
    backward = min(e["ts"] for e in ranges
                   if e["name"].startswith("autograd::engine::evaluate_function"))  # fmt: skip

    def kind(ts: float) -> str:
        if any(a <= ts <= b for a, b in fsdp):
            return "fsdp"
        if any(a <= ts <= b for a, b in comm):
            return "comm"
        return "temporaries" if ts >= backward else "activations"

    memory = [
        e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]
    theirs: set[int] = set()
    live: dict[int, tuple[int, str]] = {}  # address -> (bytes, kind)
    total, peak, at_peak = 0, None, {}
    for e in sorted(memory, key=lambda e: e["ts"]):
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0 and e["tid"] != tid:
            theirs.add(addr)
        if addr in theirs:
            if nbytes < 0:
                theirs.discard(addr)
            continue
        if nbytes > 0 and addr in live:  # its free was not recorded
            total -= live.pop(addr)[0]
        if nbytes > 0:
            live[addr] = (nbytes, kind(e["ts"]))
        else:
            live.pop(addr, None)
        total += nbytes  # a free of a block made before the step lowers it too
        if nbytes > 0 and (peak is None or total > peak):
            peak, at_peak = total, dict(live)
    sums = {"activations": 0, "temporaries": 0, "fsdp": 0, "comm": 0}
    for nbytes, block_kind in at_peak.values():
        sums[block_kind] += nbytes
    return {k: sums[k] for k in ("activations", "temporaries")}


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--loss-chunk-bytes"]:
        loss.CHUNK_BYTES, args = int(args[1]), args[2:]
    if args[:1] != ["--tp-degrees"]:
        sys.exit("usage: tp_memory.py [--loss-chunk-bytes B] --tp-degrees K,... TRAIN_FLAGS...")
    degrees, args = [int(k) for k in args[1].split(",")], args[2:]
    dist.init_process_group("gloo")
    settle_after_wait()
    settle_after_functional_wait()
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
