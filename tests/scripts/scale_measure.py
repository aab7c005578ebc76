"""One rank of a real CPU run (gloo) measured by the tracker and counter ``fsdp2lab plan``
simulates with: the trainer's model (``build_model``) and optimizer, a tracked steady step of
``scale.simulate.train_step``. Rank 0 prints one JSON line: peak tensor bytes, by category, its
sharded state, and its collectives (calls and bytes by mesh dimension).

Under ``--pp`` each rank's stage runs the trainer's :class:`fsdp2lab.parallel.pp.Pipeline` (torch's
schedule, activations and gradients sent between real ranks): one untracked step first (the
schedule infers the shapes sent between stages from it), then the tracked one. Rank 0 prints
``{"stages": [...]}``: the same figures for the first rank of each stage.

torchrun --nproc-per-node N tests/scripts/scale_measure.py TRAIN_FLAGS...
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.parallel.pp import Pipeline
from fsdp2lab.parallel.strategies import build_model
from fsdp2lab.plan import resolve
from fsdp2lab.runtime.distributed import exit_process
from fsdp2lab.runtime.mesh import build_mesh
from fsdp2lab.scale.simulate import StepCounter, _batch, _group_dims, track, train_step
from fsdp2lab.training.metrics import state_bytes
from fsdp2lab.training.optim import build_optimizer


def main() -> None:
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    cfg = config_from_args(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = resolve(cfg, world)
    mesh = build_mesh(plan.dims, "cpu")
    device = torch.device("cpu")
    model = build_model(plan, mesh, device)
    optimizer = build_optimizer(model.parameters(), plan.cfg)
    torch.manual_seed(rank)
    pipeline = None
    if plan.dims.pp > 1:
        pipeline = Pipeline(model, mesh, device, plan.n_microbatches, plan.cfg.pp_schedule)
        train_step(plan, model, optimizer, lambda: _batch(plan), pipeline=pipeline)
        optimizer.zero_grad(set_to_none=True)
    counter = StepCounter(_group_dims(mesh))
    peak, by_category = track(
        plan, model, optimizer, lambda: _batch(plan), (counter,), pipeline=pipeline
    )
    result = {
        "peak_bytes": peak,
        "by_category": by_category,
        "state": state_bytes(model, optimizer),
        "comm": {
            dim: {kind: [c.calls, c.tensor_bytes] for kind, c in kinds.items()}
            for dim, kinds in counter.comm.items()
        },
    }
    if pipeline is not None:
        result["stage"] = pipeline.stage_index
        results: list = [None] * world
        dist.all_gather_object(results, result)
        per_stage = world // plan.dims.pp
        result = {"stages": results[::per_stage]}
    if rank == 0:
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
