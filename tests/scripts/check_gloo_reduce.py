"""FSDP2 on gloo with its gradients reduced by an all-to-all (``reduce_by_all_to_all``) against
gloo's own reduce-scatter, on one process group: 16 AdamW steps of the same model from the same
bits, the gloo collectives each step records (torch's profiler), and the function by itself on
sum, max and bf16. Each rank writes OUT/rank-R.json. Run under torchrun with 2 ranks."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from fsdp2lab.parallel.fsdp2 import all_to_all_reduce_scatter, apply_fsdp
from fsdp2lab.runtime.distributed import exit_process
from fsdp2lab.runtime.torch_compat import local_tensor

STEPS = 16
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def _bytes_written() -> int:
    """What this process (gloo's threads among it) has passed to write calls, sockets included:
    the kernel's count (/proc/self/io wchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def train(all_to_all: bool) -> tuple[list[float], list[torch.Tensor], dict]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(n, 40), nn.Tanh()) for n in (12, 40, 40)]
    model = nn.Sequential(*layers, nn.Linear(40, 5))
    apply_fsdp(model, mesh, layers, unit_policy="layer", reduce_by_all_to_all=all_to_all)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + rank)
    losses, collectives = [], {}
    for step in range(STEPS):
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        written = _bytes_written()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            loss.backward()
        written = _bytes_written() - written
        if step == STEPS - 1:  # a steady step's gloo collectives: count and input elements
            for e in prof.events():
                if e.name.startswith("gloo:"):
                    entry = collectives.setdefault(e.name, [0, 0])
                    entry[0] += 1
                    entry[1] += sum(torch.Size(s).numel() for s in e.input_shapes if s)
            collectives["backward_bytes_written"] = written
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [local_tensor(p).clone() for p in model.parameters()], collectives


def function_checks() -> dict:
    """all_to_all_reduce_scatter against the chunk of the whole sum (in rank order), and ReduceOp.MAX
    (handed to gloo's own reduce-scatter)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(world * 6, generator=gen).to(dtype)
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        expected = torch.stack(every).sum(0).chunk(world)[rank]
        got = torch.empty(6, dtype=dtype)
        all_to_all_reduce_scatter(got, x, dist.group.WORLD, dist.ReduceOp.SUM)
        out[f"sum_{dtype}"] = torch.equal(got, expected)
    x = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    got = torch.empty(4)
    all_to_all_reduce_scatter(got, x, dist.group.WORLD, dist.ReduceOp.MAX)
    out["max"] = torch.equal(got, (x / (rank + 1) * world).chunk(world)[rank])
    return out


gloo_losses, gloo_params, gloo_collectives = train(all_to_all=False)
a2a_losses, a2a_params, a2a_collectives = train(all_to_all=True)
report = {
    "rank": rank,
    "losses_equal": gloo_losses == a2a_losses,
    "losses": a2a_losses,
    "params_equal": all(torch.equal(a, b) for a, b in zip(gloo_params, a2a_params, strict=True)),
    "collectives": {"gloo": gloo_collectives, "all_to_all": a2a_collectives},
    "function": function_checks(),
}
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(report))
exit_process(0)
