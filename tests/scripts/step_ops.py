"""The ops a training step dispatches: fsdp2lab's ``Trainer.train_step`` (with the hooks a run
gets) against the plain loop a user writes over the same model (forward, ``F.cross_entropy``,
backward, fused AdamW, ``zero_grad``), one CPU rank; under torchrun, the trainer's on each rank
(no plain loop: a rank's plain loop is one process's over its own micro-batch).

A ``TorchDispatchMode`` sees every op at the top of the dispatcher (a DTensor op once, as itself)
and files it under the part of the step that issued it: ``backward`` (inside autograd's engine,
outside FSDP2's hooks), ``fsdp2`` (``torch.distributed.fsdp``), ``dtensor``, ``optimizer``
(``torch.optim``), and fsdp2lab's own modules (``loss``, ``nan_guard``, ``grad_norm``,
``step_records``, ``trainer``, ...), else ``forward`` (the model, also a library's: transformers,
PEFT). The data loader's work on the
host is left out (``step_syncs.HostLoader``). The plain loop runs two steps (the optimizer state
made), then one counted; the trainer runs ``fit`` over 5 steps with a record every 4, counted
per step as ``step_syncs.PerStep`` does: step 3 writes no record, step 4 does. Prints one JSON
line: ``{"plain": {part: {op: n}, "cost": {part: {"flops": n, "bytes": n}}}, "trainer": {...},
"trainer_record": {...}, "params": the model's parameter count}`` (rank 0's).

python tests/scripts/step_ops.py TRAIN_FLAGS...
torchrun --nproc-per-node 2 tests/scripts/step_ops.py TRAIN_FLAGS...
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from step_syncs import HostLoader, PerStep
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.models.spec import logits_of
from fsdp2lab.runtime.distributed import Runtime, exit_process
from fsdp2lab.training.session import build_hooks
from fsdp2lab.training.trainer import Trainer

# torch's formulas; addmm_ (the fused LoRA adapter's) as addmm
FORMULAS = {**flop_registry, torch.ops.aten.addmm_: flop_registry[torch.ops.aten.addmm]}

TORCH = Path(torch.__file__).parent
SRC = Path(__file__).resolve().parents[2] / "src" / "fsdp2lab"
TORCH_PARTS = {"distributed/fsdp": "fsdp2", "distributed/tensor": "dtensor", "optim": "optimizer"}


def part_of(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame's part that names one (see the docstring)."""
    in_backward = torch._C._current_autograd_node() is not None
    for frame in reversed(stack):
        path = Path(frame.filename)
        if path.is_relative_to(TORCH):
            rel = path.relative_to(TORCH).as_posix()
            for prefix, part in TORCH_PARTS.items():
                if rel.startswith(prefix):
                    return part
        elif path.is_relative_to(SRC):
            if in_backward:
                return "backward"
            rel = path.relative_to(SRC)
            return "forward" if rel.parts[0] == "models" else path.stem
        elif path.name == Path(__file__).name:
            return "backward" if in_backward else "plain loop"
        elif "site-packages" in path.parts:  # a library's model code (transformers, PEFT)
            return "backward" if in_backward else "forward"
    return "backward" if in_backward else "forward"


def _bytes(value) -> int:
    tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"}


def launches_work(func) -> bool:
    """Whether ``func`` (not a view) would launch work on a GPU: not a profiler marker or an
    allocation."""
    name = func._schema.name
    return not name.startswith("profiler::") and name not in ALLOCATIONS


class CountOps(TorchDispatchMode):
    """Ops by part, with each part's FLOPs (torch's own formulas, ``flop_registry``), bytes
    moved (every tensor an op reads and writes, once; views move none) and ops that would launch
    work on a GPU (``launches_work``)."""

    def __init__(self):
        super().__init__()
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self.parts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.cost: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            part = part_of(traceback.extract_stack()[:-1])
            self.parts[part][func._schema.name] += 1
            formula = FORMULAS.get(func._overloadpacket)
            if formula is not None:
                self.cost[part]["flops"] += formula(*args, **kwargs, out_val=out)
            if not func.is_view:
                self.cost[part]["bytes"] += _bytes((args, kwargs)) + _bytes(out)
                if launches_work(func):
                    self.cost[part]["launches"] += 1
        return out

    def take(self) -> dict:
        """The ops so far by part (and each part's ``cost``), which start again from none."""
        ops = {part: dict(counts) for part, counts in sorted(self.parts.items())}
        keys = ("flops", "bytes", "launches")
        cost = {part: {k: c[k] for k in keys} for part, c in self.cost.items()}
        self._reset()
        return {**ops, "cost": dict(sorted(cost.items()))}


def plain_loop(trainer: Trainer, counter: CountOps):
    """A user's loop over ``trainer``'s (unwrapped) model and batches."""
    model = trainer.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=trainer.cfg.lr, fused=True)
    batches = iter(HostLoader(trainer.loader, counter))

    def step():
        x, y = next(batches)
        logits = logits_of(model(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    flags = sys.argv[1:]
    parser = build_parser()
    run = ["--max-steps", "5", "--log-every-steps", "4"]
    cfg = config_from_args(parser.parse_args(["train", *flags, *run]))
    plain_cfg = config_from_args(parser.parse_args(["train", *flags, "--strategy", "single"]))
    counter = CountOps()
    with tempfile.TemporaryDirectory() as tmp:
        if "WORLD_SIZE" in os.environ:  # under torchrun: its ranks
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        rank, world = dist.get_rank(), dist.get_world_size()
        runtime = Runtime(rank, world, rank, torch.device("cpu"), "gloo")
        result = {}
        if world == 1:  # the plain loop of one process: a rank's own ops are the same
            plain = plain_loop(Trainer(plain_cfg, runtime), counter)
            with counter:
                for _ in range(2):
                    plain()
                counter.take()
                plain()
            result["plain"] = counter.take()
        trainer = Trainer(cfg, runtime, hooks=build_hooks(cfg, runtime))
        per_step = PerStep(counter, trainer)
        trainer.hooks.append(per_step)
        trainer.loader = HostLoader(trainer.loader, counter)
        with counter:
            trainer.fit()
        result["trainer"], result["trainer_record"] = per_step.steps[3], per_step.steps[4]
        result["params"] = sum(p.numel() for p in trainer.model.parameters())  # whole, not shards
        if rank == 0:
            print(json.dumps(result))
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
