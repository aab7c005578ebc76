"""Compare the ring collectives with gloo's own; each rank writes its checks to OUT/rank-R.json.

Run under torchrun with 2 or 4 ranks; with 4 it also checks the 2-rank subgroups of a 2 x 2 mesh
(the HSDP shard groups).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2lab.parallel.gloo_ring import RingAllGather, RingReduceScatter
from fsdp2lab.runtime.torch_compat import all_gather_single, reduce_scatter_single

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
groups = [dist.group.WORLD]
if world == 4:
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups.append(shard_groups[rank // 2])
checks = {}
for g in groups:
    n = g.size()
    for numel, dtype in (
        (n * 7, torch.float32),
        (n * 1001, torch.float32),
        (n * 64, torch.bfloat16),
    ):
        gen = torch.Generator().manual_seed(1000 * rank + numel)
        full = torch.randn(numel, generator=gen).to(dtype)
        shard = full[: numel // n].clone()
        # all-gather: identical bytes
        ours, theirs = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        assert RingAllGather()(ours, shard, g) is None
        all_gather_single(theirs, shard, group=g)
        checks[f"ag n={n} numel={numel} {dtype}"] = bool(torch.equal(ours, theirs))
        # reduce-scatter, SUM and AVG: equal up to the order of the additions
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            ours, theirs = (
                torch.empty(numel // n, dtype=dtype),
                torch.empty(numel // n, dtype=dtype),
            )
            before = full.clone()
            RingReduceScatter()(ours, full, g, op)
            assert torch.equal(full, before), "the input was modified"
            reduce_scatter_single(theirs, full.clone(), dist.ReduceOp.SUM, group=g)
            if op == dist.ReduceOp.AVG:
                theirs /= n
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            checks[f"rs {op} n={n} numel={numel} {dtype}"] = bool(
                torch.allclose(ours.float(), theirs.float(), atol=tol, rtol=tol)
            )
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "checks": checks}))
dist.destroy_process_group()
