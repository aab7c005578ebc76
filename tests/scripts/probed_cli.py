"""``fsdp2lab ARGS`` in this process, watched by torch's global hooks (for one-rank runs, which
train in this process). The probe's findings go to the JSON file ``PROBE_FILE``, rewritten when
they change (the CLI ends its process without interpreter teardown):

- ``linear_outputs``: the dtypes of every ``nn.Linear`` output in a training forward
  (``register_module_forward_hook``);
- ``params``, ``grads``, ``optimizer_state``: the devices of the optimizer's parameters, their
  gradients and its state tensors (a DTensor's local shard; the state's 0-d ``step`` counters left
  out), as each optimizer step starts (``register_optimizer_step_pre_hook``), with their counts;
- ``optimizer_state_bytes``: the bytes of those state tensors;
- ``max_memory_allocated``: ``torch.cuda.max_memory_allocated()`` then (on a GPU).

python tests/scripts/probed_cli.py PROBE_FILE train FLAGS...
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Probe:
    def __init__(self, path: str):
        self.path = path
        self.found: dict = {"linear_outputs": []}
        self.written = ""

    def write(self) -> None:
        text = json.dumps(self.found, sort_keys=True)
        if text != self.written:
            with open(f"{self.path}.tmp", "w") as f:
                f.write(text)
            os.replace(f"{self.path}.tmp", self.path)
            self.written = text

    def forward(self, module, args, output) -> None:
        if isinstance(module, nn.Linear) and module.training and torch.is_grad_enabled():
            dtype = str(local(output).dtype)
            if dtype not in self.found["linear_outputs"]:
                self.found["linear_outputs"].append(dtype)
                self.write()

    def optimizer_step(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        state = [local(v) for p in params for v in optimizer.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]  # fmt: skip

        def devices(tensors) -> dict:
            return {
                "devices": sorted({local(t).device.type for t in tensors}),
                "count": len(tensors),
            }

        state_bytes = sum(t.numel() * t.element_size() for t in state)
        self.found.update(params=devices(params), grads=devices(grads),
                          optimizer_state=devices(state), optimizer_state_bytes=state_bytes)  # fmt: skip
        if torch.cuda.is_available():
            self.found["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        self.write()


def main() -> None:
    probe = Probe(sys.argv[1])
    nn.modules.module.register_module_forward_hook(probe.forward)
    register_optimizer_step_pre_hook(probe.optimizer_step)
    sys.argv = ["fsdp2lab", *sys.argv[2:]]
    runpy.run_module("fsdp2lab", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
