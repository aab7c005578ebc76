"""One rank of a real CPU run (gloo): the trainer's own steps (``Trainer.train_step``, as
``fit`` runs them), measured by torch's profiler, not by anything ``fsdp2lab plan`` simulates with.

* collectives: the events the gloo backend itself records (``gloo:all_gather``, ...), each with
  its input's shape and dtype;
* memory: the CPU allocator's events (``profile_memory``: each allocation and free, its address
  and thread) summed into a running total of the step's own blocks (gloo's worker threads'
  staging buffers left out: ``_allocations``), plus the parameter and buffer storages made
  before the profiler started (counted here, each storage once).

Each collective's wait is followed by a short pause (``settle_after_wait``), so that what the step
does next never depends on whether gloo's worker thread has let go of the collective's tensors
yet: the same step then measures the same peak, run after run.

One warm-up step (the optimizer state made; under ``--pp`` the schedule's shapes inferred), then
``STEPS`` steps, each after a barrier and measured on its own. Rank 0 prints one JSON line,
``{"stages": [...]}``, for the first rank of each pipeline stage (one entry without ``--pp``):
``{"optimizer_state_bytes": ..., "steps": [{"peak_bytes": ..., "seen_peak_bytes": ..., "comm":
{kind: [calls, input bytes]}}, ...]}``; ``seen_peak_bytes`` is the peak without the blocks an
operator allocates inside its own C++ code (``hidden_ranges``), which FSDP2's memory tracker does
not see.

torchrun --nproc-per-node N tests/scripts/scale_measure.py TRAIN_FLAGS...
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.profiler import ProfilerActivity, profile, record_function

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.runtime.distributed import Runtime, exit_process
from fsdp2lab.training.trainer import Trainer

STEPS = 3
SETTLE_S = 0.005
_ITEM = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
         "unsigned char": 1, "bool": 1}  # fmt: skip


def storage_bytes(model: torch.nn.Module) -> int:
    """The bytes of the storages behind the model's parameters and buffers (a DTensor's local
    shard), each storage once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        for part in _plain(t.to_local() if hasattr(t, "to_local") else t):
            storage = part.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: a tensor subclass's inner tensors (an NF4
    weight's packed values and scales), else ``t``."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [part for name in names for part in _plain(getattr(t, name))]


def step_figures(
    events: list[dict], name: str, base: int, optimizer_state: int, seen_only: bool = False
) -> dict:
    """The gloo collectives inside record range ``name``, and the peak of live tensor bytes in it:
    the parameters and buffers (``base``), the optimizer state, the last step's gradients (what
    the step's ``zero_grad`` frees) and the most the running total rises above its value at the
    step's start. ``seen_only``: without the blocks allocated in :func:`hidden_ranges`."""
    start, end, tid = _range(events, name)
    zero_start, zero_end, _ = _range(events, "Optimizer.zero_grad#", start)
    peak, comm, at_start, grads = 0, {}, 0, 0
    left_out = hidden_ranges(events, tid) if seen_only else []
    for ts, nbytes, total in _allocations(events, tid, left_out):
        if ts < start:
            at_start = total
        elif ts <= end:
            peak = max(peak, total)
            if zero_start <= ts <= zero_end and nbytes < 0:
                grads -= nbytes
    for e in events:
        name = e.get("name", "")
        if start <= e.get("ts", -1) <= end and name.startswith("gloo:") and e.get("ph") == "X":
            args = e["args"]
            nbytes = 0
            for dims, dtype in zip(args["Input Dims"], args["Input type"], strict=True):
                numel = 1
                for d in dims:
                    numel *= d
                nbytes += numel * _ITEM[dtype]
            entry = comm.setdefault(name.removeprefix("gloo:"), [0, 0])
            entry[0] += 1
            entry[1] += nbytes
    return {"peak_bytes": base + optimizer_state + grads + peak - at_start, "comm": comm}


def _range(events: list[dict], prefix: str, after: float = 0) -> tuple[float, float, int]:
    """(start, end, thread) of the first record range named ``prefix...`` that starts at
    ``after`` or later."""
    e = next(
        e
        for e in events
        if e.get("ph") == "X" and e.get("name", "").startswith(prefix) and e["ts"] >= after
    )
    return e["ts"], e["ts"] + e["dur"], e["tid"]


def created_by_first_step(events: list[dict]) -> int:
    """The bytes the optimizer's first step leaves allocated (its state): the allocator's total
    at the end of the first ``Optimizer.step#...`` range less that at its start."""
    start, end, tid = _range(events, "Optimizer.step#")
    before = after = 0
    for ts, _, total in _allocations(events, tid):  # in time order
        if ts < start:
            before = total
        if ts <= end:
            after = total
    return after - before


def hidden_ranges(events: list[dict], tid: int) -> list[tuple[float, float]]:
    """Where thread ``tid`` allocates blocks inside one operator's own C++ code, below the
    dispatch that FSDP2's memory tracker (and so ``fsdp2lab plan``) sees: gloo's staging copy of
    a collective's input (``c10d::...``: it has no reduce-scatter, and all-reduces a copy), and
    the workspace of convolution's backward (an ``aten::empty`` inside
    ``aten::convolution_backward``)."""
    ops = [e for e in events if e.get("ph") == "X" and e["tid"] == tid]
    conv = [(e["ts"], e["ts"] + e["dur"]) for e in ops if e["name"] == "aten::convolution_backward"]
    return [(e["ts"], e["ts"] + e["dur"]) for e in ops
            if e["name"].startswith("c10d::")
            or (e["name"] == "aten::empty"
                and any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in conv))]  # fmt: skip


def _allocations(
    events: list[dict], tid: int, left_out: list[tuple[float, float]] = ()
) -> list[tuple[float, int, int]]:
    """(time, bytes, running total) of each CPU allocator event of the step's code, in time order:
    the blocks thread ``tid`` allocates and every free of them, and the frees of blocks made before
    the profiler started. Left out: the blocks gloo's worker threads allocate and free themselves
    (each collective's staging buffer, as NCCL keeps its own outside the caching allocator), whose
    times race the step's own allocations. A block whose free the profiler did not record (gloo's
    staging copy of a collective's input, freed by its worker thread) is freed at the end of its
    wait where that is known (:func:`_staging_frees`), else at the latest when the allocator hands
    its address out again: counted as freed then."""
    theirs: set[int] = set()
    ours: dict[int, int] = {}
    total, out = 0, []
    cpu = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    cpu.sort(key=lambda e: e["ts"])
    for e in sorted([*cpu, *_staging_frees(events, cpu, tid)], key=lambda e: e["ts"]):
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0 and (e["tid"] != tid or any(a <= e["ts"] <= b for a, b in left_out)):
            theirs.add(addr)
        if addr in theirs:
            if nbytes < 0:
                theirs.discard(addr)
            continue
        if nbytes > 0 and addr in ours:  # its free was not recorded
            total -= ours[addr]
            out.append((e["ts"], -ours[addr], total))
        if nbytes > 0:
            ours[addr] = nbytes
        else:
            ours.pop(addr, None)
        total += nbytes
        out.append((e["ts"], nbytes, total))
    return out


def _staging_frees(events: list[dict], cpu: list[dict], tid: int) -> list[dict]:
    """A free event at the end of its wait for each staging copy that gloo makes of a functional
    collective's input (a ``c10d::...`` op inside ``_c10d_functional::...``, on thread ``tid``):
    gloo's worker thread frees it, in the pause after the wait, on no profiled thread."""
    ops = [e for e in events if e.get("ph") == "X" and e["tid"] == tid]
    issued = [(e["ts"], e["ts"] + e["dur"]) for e in ops
              if e["name"].startswith("_c10d_functional::") and "wait" not in e["name"]]  # fmt: skip
    staging = [(e["ts"], e["ts"] + e["dur"]) for e in ops
               if e["name"].startswith("c10d::") and any(a <= e["ts"] <= b for a, b in issued)]  # fmt: skip
    waits = sorted(e["ts"] + e["dur"] for e in ops if e["name"] == "_c10d_functional::wait_tensor")
    unfreed: dict[int, dict] = {}  # address -> its staging copy's allocation, no free recorded yet
    out = []

    def free_at_wait(e: dict) -> None:
        ts = next((w for w in waits if w > e["ts"]), None)
        if ts is not None:
            out.append({"ts": ts, "tid": tid, "args": {"Addr": e["args"]["Addr"],
                                                       "Bytes": -e["args"]["Bytes"]}})  # fmt: skip

    for e in cpu:  # in time order
        addr = e["args"]["Addr"]
        if addr in unfreed and e["args"]["Bytes"] > 0:
            free_at_wait(unfreed.pop(addr))
        unfreed.pop(addr, None)
        if (
            e["args"]["Bytes"] > 0
            and e["tid"] == tid
            and any(a <= e["ts"] <= b for a, b in staging)
        ):
            unfreed[addr] = e
    for e in unfreed.values():
        free_at_wait(e)
    return out


def settle_after_wait() -> None:
    """Follow each collective's wait with a pause of ``SETTLE_S``, in which gloo's worker thread
    lets go of the collective's tensors: the step then goes on as the plan has it, each collective
    complete and its buffers freed. Waited so: ``Work.wait`` (FSDP2's, pipelining's, the
    data-parallel ones) and DTensor's functional collectives (under ``--tp``), which are waited as
    soon as they are issued rather than when their result is first used."""
    work = dist.distributed_c10d.Work
    work_wait = work.wait
    funcol_wait = funcol.wait_tensor

    def wait_and_settle(self, *args, **kwargs):
        done = work_wait(self, *args, **kwargs)
        time.sleep(SETTLE_S)
        return done

    def wait_tensor_and_settle(tensor):
        done = funcol_wait(tensor)
        time.sleep(SETTLE_S)
        return done

    work.wait = wait_and_settle
    funcol.wait_tensor = wait_tensor_and_settle
    funcol._maybe_wrap_tensor = wait_tensor_and_settle
    funcol._maybe_wrap_tensors = lambda tensors: [wait_tensor_and_settle(t) for t in tensors]


def start_trainer() -> tuple[Trainer, int, int]:
    """This rank's Trainer from the ``train`` flags on the command line (gloo, every collective's
    wait followed by the pause), at the start of epoch 1: (trainer, rank, world size)."""
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    cfg = config_from_args(args)
    dist.init_process_group("gloo")
    settle_after_wait()
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime = Runtime(rank, world, int(os.environ["LOCAL_RANK"]), torch.device("cpu"), "gloo")
    trainer = Trainer(cfg, runtime)
    trainer.sampler.set_epoch(1, 0)
    return trainer, rank, world


def profiled_steps(trainer: Trainer, names: list[str]) -> list[dict]:
    """The profiler's trace events of a first step (the optimizer state made), then one step per
    name, each after a barrier and recorded under that name."""
    batches = iter(trainer.loader)
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
    ) as prof:
        trainer.train_step(batches)
        for name in names:
            dist.barrier()
            with record_function(name):
                trainer.train_step(batches)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def main() -> None:
    trainer, rank, world = start_trainer()
    base = storage_bytes(trainer.model)
    events = profiled_steps(trainer, [f"measured step {i}" for i in range(STEPS)])
    state = created_by_first_step(events)
    steps = []
    for name in [f"measured step {i}" for i in range(STEPS)]:
        step = step_figures(events, name, base, state)
        step["seen_peak_bytes"] = step_figures(events, name, base, state, True)["peak_bytes"]
        steps.append(step)
    result = {"optimizer_state_bytes": state, "steps": steps}
    results: list = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        per_stage = world // trainer.plan.dims.pp
        print(json.dumps({"stages": results[::per_stage]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
