"""Run under torchrun: build a Trainer from ``fsdp2lab train`` flags, train, and report per rank
how its parameters are held, which FSDP modules prefetch which, and (a gpt) whether the output
head's gradient was already reduced when the first block's backward began (as JSON in
$OUT_DIR/rank<N>.json) for tests/test_fsdp2.py."""

import argparse
import json
import os
import sys

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.runtime import distributed, launch_env
from fsdp2lab.training.trainer import Trainer


def prefetch_lists(model) -> dict:
    """Each FSDP module's explicit prefetch targets, by module name ("" is the root). FSDP2 keeps
    them on the module's state (FSDPModule.set_modules_to_forward_prefetch and its backward twin
    set these lists; torch 2.8 to 2.14)."""
    fsdp = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    state_name = {id(m._get_fsdp_state()): name for name, m in fsdp.items()}
    return {
        name: {
            "forward": [state_name[id(s)] for s in m._get_fsdp_state()._states_to_forward_prefetch],
            "backward": [
                state_name[id(s)] for s in m._get_fsdp_state()._states_to_backward_prefetch
            ],
        }
        for name, m in fsdp.items()
    }


def watch_head_gradient(model) -> dict:
    """{"head_grad_in_layer_backward": bool}, filled when the first step's backward reaches the
    first block: whether the head's sharded gradient was set by then (its own unit's reduce-scatter
    ran) or not (the root's, at the end of the backward)."""
    seen: dict = {}
    head = model.get_submodule("lm_head").weight

    def pre_hook(module, grad_output):
        seen.setdefault("head_grad_in_layer_backward", head.grad is not None)

    model.get_submodule("blocks.0.mlp").register_full_backward_pre_hook(pre_hook)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(sys.argv[1:]))
    runtime = distributed.init(launch_env.detect(), cfg.device)
    try:
        trainer = Trainer(cfg, runtime)
        head = watch_head_gradient(trainer.model) if cfg.model == "gpt" else {}
        trainer.fit()
        report = {
            "params": {
                name: {
                    "dtensor": isinstance(p, DTensor),
                    "placements": [
                        f"{type(pl).__name__}({getattr(pl, 'dim', '')})" for pl in p.placements
                    ]
                    if isinstance(p, DTensor)
                    else None,
                    "mesh": list(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else None,
                    "dtype": str(p.dtype),
                    "local_numel": (p.to_local() if isinstance(p, DTensor) else p).numel(),
                    "numel": p.numel(),
                }
                for name, p in trainer.model.named_parameters()
            },
            "prefetch": prefetch_lists(trainer.model),
            **head,
        }
        with open(os.path.join(os.environ["OUT_DIR"], f"rank{runtime.rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
