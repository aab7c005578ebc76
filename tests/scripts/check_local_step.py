"""The optimizer step on local shards against the same step on DTensors, on FSDP2 with uneven
shards; each rank writes its checks to OUT/rank-R.json. Run under torchrun with 2 ranks."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from fsdp2lab.config import TrainConfig
from fsdp2lab.parallel.local_step import step_on_local_shards
from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.torch_compat import local_tensor
from fsdp2lab.training.optim import build_optimizer

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def configured(**kwargs):
    """fsdp2lab's optimizer, as the trainer builds it (local) or stepping on the DTensors (ref)."""
    cfg = TrainConfig(weight_decay=0.01, **kwargs)
    return lambda ps, local: build_optimizer(ps, cfg, local_step=local)


def foreach_adam(ps, local):
    opt = torch.optim.Adam(ps, lr=2e-3, foreach=True)
    if local:
        step_on_local_shards(opt)
    return opt


OPTIMIZERS = {
    "adadelta": configured(optimizer="adadelta", lr=1.0),
    "adam": configured(optimizer="adam", lr=2e-3),  # fused
    "adamw": configured(optimizer="adamw", lr=2e-3),  # fused
    "adam-foreach": foreach_adam,
    "sgd": configured(optimizer="sgd", lr=0.05, momentum=0.9),
}


def model() -> nn.Module:
    torch.manual_seed(0)  # 5 and 3 rows over 2 ranks: uneven shards, one of them 1 row
    m = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
    for layer in m[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def equal(a, b) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    return torch.equal(*(local_tensor(t) if isinstance(t, DTensor) else t for t in (a, b)))


def on_dtensors(opt) -> list[bool]:
    """Records, at every step, whether the step ran on the DTensors (a hook after ours)."""
    seen = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append(isinstance(o.param_groups[0]["params"][0], DTensor))
    )
    return seen


checks = {}
for name, make in OPTIMIZERS.items():
    ref_model, local_model = model(), model()
    ref, local = make(ref_model.parameters(), False), make(local_model.parameters(), True)
    seen = on_dtensors(local)
    gen = torch.Generator().manual_seed(rank)
    for step in range(15):
        x = torch.randn(8, 7, generator=gen)
        for m, opt in ((ref_model, ref), (local_model, local)):
            m(x).square().mean().backward()
            if step == 5:  # a gradient laid out unlike its parameter: this step on DTensors
                p = next(m.parameters())
                p.grad = p.grad.redistribute(placements=[Replicate()])
            opt.step()
            opt.zero_grad()
            if step == 9:  # new state objects, as a resumed checkpoint loads
                before = {id(v) for s in opt.state.values() for v in s.values()}
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                after = {id(v) for s in opt.state.values() for v in s.values()}
                reloaded_new_state = not before & after
    pairs = list(zip(ref_model.parameters(), local_model.parameters(), strict=True))
    checks[name] = {
        "on_dtensors": seen,
        "params_equal": all(equal(a, b) for a, b in pairs),
        "state_equal": all(
            ref.state[a].keys() == local.state[b].keys()
            and all(equal(v, local.state[b][k]) for k, v in ref.state[a].items())
            for a, b in pairs
        ),
        "state_keyed_by_params": all(p in local.state for p in local_model.parameters()),
        "local_grads_released": all(local_tensor(p).grad is None for _, p in pairs),
        "reloaded_new_state": reloaded_new_state,
    }


class Rebinding(torch.optim.SGD):
    """Replaces its state tensor at every step: cannot step on local shards."""

    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            self.state[p]["buf"] = torch.zeros_like(p)
        return super().step(closure)


opt = Rebinding(list(model().parameters()), lr=0.1)
step_on_local_shards(opt)
for p in opt.param_groups[0]["params"]:
    p.grad = torch.ones_like(p)
opt.step()
try:
    opt.step()
    checks["rebinding"] = "no error"
except RuntimeError as e:
    checks["rebinding"] = str(e)
checks["plain_params"] = step_on_local_shards(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "checks": checks}))
dist.destroy_process_group()
distributed.exit_process(0)
