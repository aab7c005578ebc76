"""The ops a training step dispatches: fsdp2lab's ``Trainer.train_step`` (with the hooks a run
gets) against the plain loop a user writes over the same model (forward, ``F.cross_entropy``,
backward, fused AdamW, ``zero_grad``), one CPU rank; under torchrun, the trainer's on each rank
(no plain loop: a rank's plain loop is one process's over its own micro-batch).

A ``TorchDispatchMode`` sees every op at the top of the dispatcher (a DTensor op once, as itself)
and files it under the part of the step that issued it: ``backward`` (inside autograd's engine,
outside FSDP2's hooks and the loss's own gradients), ``fsdp2`` (``torch.distributed.fsdp``, and
fsdp2lab's ``parallel/fsdp2.py``: its reduce-scatter on gloo), ``dtensor``, ``optimizer`` (``torch.optim``), and fsdp2lab's own modules (``loss``,
``nan_guard``, ``grad_norm``, ``step_records``, ``trainer``, ...; ``runtime/torch_compat.py``'s shims take their caller's),
else ``forward`` (the model,
also a library's: transformers, PEFT). The data loader's work on the host is left out
(``step_syncs.HostLoader``). The plain loop runs two steps (the optimizer state made), then one
counted; the trainer runs ``fit`` over 5 steps with a record every 4, counted per step as
``step_syncs.PerStep`` does: step 3 writes no record, step 4 does.

ROWS is a JSON object ``{row: [flags]}``: each row is counted with TRAIN_FLAGS and its own flags,
one after another in the same process (and process group). The script's own ``--loss-chunks N``
cuts a micro-batch's tokens into N loss chunks, as a large vocabulary would
(``loss.CHUNK_BYTES`` made one chunk's fp32 logits). Prints one JSON line (rank 0's):
``{row: {"plain": {part: {op: n}, "cost": {part: {"flops": n, "bytes": n, "launches": n}}},
"trainer": {...}, "trainer_record": {...}, "params": n, "grad_bytes": n, "units": n,
"adapters": n, "loss_chunks": n}}``: the model's parameters (whole) and trainable parameters'
bytes, its FSDP2 units, PEFT-adapted linears.

python tests/scripts/step_ops.py ROWS TRAIN_FLAGS...
torchrun --nproc-per-node 2 tests/scripts/step_ops.py ROWS TRAIN_FLAGS...
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from step_syncs import HostLoader, PerStep
from torch.distributed.fsdp import FSDPModule
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.models.spec import logits_of
from fsdp2lab.runtime.distributed import Runtime, exit_process
from fsdp2lab.training import loss
from fsdp2lab.training.session import build_hooks
from fsdp2lab.training.trainer import Trainer

# torch's formulas; addmm_ (the fused LoRA adapter's) as addmm
FORMULAS = {**flop_registry, torch.ops.aten.addmm_: flop_registry[torch.ops.aten.addmm]}

TORCH = Path(torch.__file__).parent
SRC = Path(__file__).resolve().parents[2] / "src" / "fsdp2lab"
TORCH_PARTS = {"distributed/fsdp": "fsdp2", "distributed/tensor": "dtensor", "optim": "optimizer"}


def part_of(frame) -> str:
    """The innermost frame's part, from ``frame`` outwards, that names one (see the docstring)."""
    in_backward = torch._C._current_autograd_node() is not None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        frame = frame.f_back
        if path.is_relative_to(TORCH):
            rel = path.relative_to(TORCH).as_posix()
            for prefix, part in TORCH_PARTS.items():
                if rel.startswith(prefix):
                    return part
        elif path.is_relative_to(SRC):
            if path.stem == "torch_compat":  # a shim: its caller's part
                continue
            if path.stem == "fsdp2":  # fsdp2lab's FSDP2 machinery (gloo's reduce-scatter)
                return "fsdp2"
            if in_backward and path.stem != "loss":  # the loss's own gradients are the loss's
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


OVERWRITES = {"aten::copy_"}  # writes its ``self`` without reading it


def moved_bytes(func, args, kwargs, out) -> int:
    """The bytes ``func`` reads and writes: its tensor arguments and results, each once, less
    the destinations it only writes (``copy_``'s ``self``, an ``out=``), which its result is."""
    names = (a.name for a in func._schema.arguments)
    named = {**dict(zip(names, args, strict=False)), **kwargs}
    overwritten = {"out", "self"} if func._schema.name in OVERWRITES else {"out"}
    return _bytes([v for name, v in named.items() if name not in overwritten]) + _bytes(out)


ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"}


def launches_work(func) -> bool:
    """Whether ``func`` (not a view) would launch work on a GPU: not a profiler marker or an
    allocation."""
    name = func._schema.name
    return not name.startswith("profiler::") and name not in ALLOCATIONS


class CountOps(TorchDispatchMode):
    """Ops by part, with each part's FLOPs (torch's own formulas, ``flop_registry``), ops that
    would launch work on a GPU (``launches_work``) and the bytes those move (``moved_bytes``;
    views and allocations move none)."""

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
            part = part_of(sys._getframe(1))
            self.parts[part][func._schema.name] += 1
            formula = FORMULAS.get(func._overloadpacket)
            if formula is not None:
                self.cost[part]["flops"] += formula(*args, **kwargs, out_val=out)
            if not func.is_view and launches_work(func):
                self.cost[part]["bytes"] += moved_bytes(func, args, kwargs, out)
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


def loss_chunks(flags: list[str]) -> tuple[list[str], int]:
    """``flags`` less the script's own ``--loss-chunks N``, and N (1 where not given)."""
    if "--loss-chunks" not in flags:
        return flags, 1
    at = flags.index("--loss-chunks")
    return flags[:at] + flags[at + 2 :], int(flags[at + 1])


def count_row(flags: list[str], runtime: Runtime, counter: CountOps) -> dict:
    """One row's counts: the plain loop's (one process only) and the trainer's steps 3 and 4,
    with the units, adapted linears and loss chunks their bounds scale with."""
    flags, chunks = loss_chunks(flags)
    parser = build_parser()
    run = ["--max-steps", "5", "--log-every-steps", "4"]
    cfg = config_from_args(parser.parse_args(["train", *flags, *run]))
    result = {}
    if runtime.world_size == 1:  # the plain loop of one process: a rank's own ops are the same
        plain_cfg = config_from_args(parser.parse_args(["train", *flags, "--strategy", "single"]))
        plain = plain_loop(Trainer(plain_cfg, runtime), counter)
        with counter:
            for _ in range(2):
                plain()
            counter.take()
            plain()
        result["plain"] = counter.take()
    # A micro-batch's tokens in ``chunks`` chunks: the chunk a large vocabulary gets, here.
    tokens = cfg.batch_size * cfg.seq_len
    chunk_bytes = 4 * cfg.vocab_size * -(-tokens // chunks) if chunks > 1 else loss.CHUNK_BYTES
    with mock.patch.object(loss, "CHUNK_BYTES", chunk_bytes):
        trainer = Trainer(cfg, runtime, hooks=build_hooks(cfg, runtime))
        per_step = PerStep(counter, trainer)
        trainer.hooks.append(per_step)
        trainer.loader = HostLoader(trainer.loader, counter)
        with counter:
            trainer.fit()
    modules = list(trainer.model.modules())
    return {
        **result,
        "trainer": per_step.steps[3],
        "trainer_record": per_step.steps[4],
        "params": sum(p.numel() for p in trainer.model.parameters()),  # whole, not shards
        "grad_bytes": sum(
            p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad
        ),
        "units": sum(isinstance(m, FSDPModule) for m in modules),
        "adapters": sum(_is_adapted(m) for m in modules),
        "loss_chunks": chunks,
    }


def main() -> None:
    rows, flags = json.loads(sys.argv[1]), sys.argv[2:]
    counter = CountOps()
    with tempfile.TemporaryDirectory() as tmp:
        if "WORLD_SIZE" in os.environ:  # under torchrun: its ranks
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        rank, world = dist.get_rank(), dist.get_world_size()
        runtime = Runtime(rank, world, rank, torch.device("cpu"), "gloo")
        result = {row: count_row([*flags, *extra], runtime, counter) for row, extra in rows.items()}
        if rank == 0:
            print(json.dumps(result))
        dist.destroy_process_group()


def _is_adapted(module) -> bool:
    """A PEFT-adapted linear (PEFT, the hf extra, is imported only where a row uses LoRA)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import Linear

    return isinstance(module, Linear)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process(0)
