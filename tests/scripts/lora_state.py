"""One rank of a real LoRA run (gloo, CPU): the trainer's own step, then the bytes this rank
holds, counted here from the tensors themselves (each DTensor's local shard), not by
``training.metrics.state_bytes``, which the trainer and ``fsdp2lab plan`` share.

Rank 0 prints one JSON line: a list, per rank, of ``frozen_param_bytes``,
``adapter_param_bytes``, ``grad_bytes``, ``grad_storage_bytes`` (the storages behind the
gradients, each once), ``optimizer_state_bytes``, ``frozen_with_grad``
(frozen parameters holding a gradient), ``frozen_with_state`` (holding optimizer state), after
two steps; ``peak_bytes``, the second step's peak of live tensor bytes as ``scale_measure.py``
measures it (torch's profiler), and ``peak_total_bytes``, the CPU allocator's highest total in
that step (everything allocated since profiling began, kept or not) plus the parameters' storages.

torchrun --nproc-per-node N tests/scripts/lora_state.py TRAIN_FLAGS...
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from scale_measure import (
    _range,
    created_by_first_step,
    profiled_steps,
    start_trainer,
    step_figures,
    storage_bytes,
)

from fsdp2lab.runtime.distributed import exit_process


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(t: torch.Tensor) -> int:
    return local(t).numel() * local(t).element_size()


def main() -> None:
    trainer, rank, world = start_trainer()
    base = storage_bytes(trainer.model)
    events = profiled_steps(trainer, ["measured step"])
    counts = dict.fromkeys(("frozen_param_bytes", "adapter_param_bytes", "grad_bytes",
                            "optimizer_state_bytes", "frozen_with_grad", "frozen_with_state"), 0)  # fmt: skip
    grad_storages: dict[int, int] = {}
    for p in trainer.model.parameters():
        counts["adapter_param_bytes" if p.requires_grad else "frozen_param_bytes"] += local_bytes(p)
        if p.grad is not None:
            counts["grad_bytes"] += local_bytes(p.grad)
            counts["frozen_with_grad"] += not p.requires_grad
            storage = local(p.grad).untyped_storage()
            grad_storages[storage.data_ptr()] = storage.nbytes()
    # What the gradients hold: FSDP1's are views into its flat parameter's gradient, which
    # covers the frozen weights of the unit too.
    counts["grad_storage_bytes"] = sum(grad_storages.values())
    state = created_by_first_step(events)
    counts["peak_bytes"] = step_figures(events, "measured step", base, state)["peak_bytes"]
    # The allocator's own total at its highest in the step (all it holds since the profile began,
    # the parameters' storages added), whatever the step frees or keeps.
    start, end, _ = _range(events, "measured step")
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
              and start <= e["ts"] <= end]  # fmt: skip
    counts["peak_total_bytes"] = base + max(totals)
    for p, state in trainer.optimizer.state.items():
        counts["frozen_with_state"] += not p.requires_grad
        for value in state.values():
            if isinstance(value, torch.Tensor):
                counts["optimizer_state_bytes"] += local_bytes(value)
    results: list = [None] * world
    dist.all_gather_object(results, counts)
    if rank == 0:
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
