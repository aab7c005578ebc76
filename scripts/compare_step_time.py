"""Paired step-time comparison of strategies in one process group (for noisy, shared machines).

Every variant is a real ``Trainer`` (same model, data and ``train_step``) built in the same ranks;
rounds time ``--steps`` steps of each variant in turn (rotating the order), so load from other jobs
falls on all variants alike. Prints, per variant, the median step time and its ratio to the faster
of DDP and FSDP1 in the same round (median and range over rounds), and with the variant
``compute-only`` (every rank a one-rank run of its share of the batch) each variant's throughput
as a share of compute only's, in the same round.

    torchrun --nproc-per-node 2 scripts/compare_step_time.py --rounds 10 -- \\
        --model cnn --dataset synthetic --progress off
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.parallel import shm_collectives
from fsdp2lab.plan import resolve
from fsdp2lab.runtime import distributed, host_memory, launch_env
from fsdp2lab.runtime.preemption import Preemption
from fsdp2lab.training import trainer as trainer_module
from fsdp2lab.training.nan_guard import NanGuard
from fsdp2lab.training.optim import build_optimizer
from fsdp2lab.training.trainer import Trainer

VARIANTS = {
    # every rank a one-rank run of its share of the batch, on a mesh of its own: no communication
    "compute-only": ["--strategy", "single"],
    "ddp": ["--strategy", "ddp"],
    "fsdp1": ["--strategy", "fsdp1"],
    "fsdp1-root": ["--strategy", "fsdp1", "--fsdp1-min-params", str(10**12)],
    "fsdp2-layer": ["--strategy", "fsdp2", "--fsdp-units", "layer"],
    "fsdp2-root": ["--strategy", "fsdp2", "--fsdp-units", "root"],
    "fsdp2-auto": ["--strategy", "fsdp2", "--fsdp-units", "auto"],
    "fsdp2-auto-builtin": ["--strategy", "fsdp2", "--gloo-collectives", "builtin"],
    "fsdp2-auto-ring": ["--strategy", "fsdp2", "--gloo-collectives", "ring"],
    "fsdp2-layer-ring": [
        "--strategy",
        "fsdp2",
        "--fsdp-units",
        "layer",
        "--gloo-collectives",
        "ring",
    ],
    "fsdp2-auto-p1": ["--strategy", "fsdp2", "--fsdp-units", "auto", "--prefetch", "1"],
    "fsdp2-layer-p1": ["--strategy", "fsdp2", "--fsdp-units", "layer", "--prefetch", "1"],
    "fsdp2-auto-1m": ["--strategy", "fsdp2", "--fsdp-unit-min-params", "1000000"],
    "fsdp2-zero2": ["--strategy", "fsdp2", "--reshard-after-forward", "false"],
    "fsdp2-layer-zero2": ["--fsdp-units", "layer", "--reshard-after-forward", "false"],
    "fsdp2-layer-zero2-p1": [
        *["--fsdp-units", "layer", "--reshard-after-forward", "false", "--prefetch", "1"]
    ],
}
# ``<variant>-dtensor-step``: the variant with its optimizer stepping on the DTensors themselves
# rather than on their local shards (``parallel/local_step.py``).
DTENSOR_STEP = "-dtensor-step"
# ``<variant>-gloo-barrier``: its shared-memory collectives pass gloo's barrier rather than
# their own (``shm_collectives.ShmBarrier``); may follow ``-dtensor-step``.
GLOO_BARRIER = "-gloo-barrier"
# ``<variant>-copied-ag``: its all-gathers gather into memory of their own, copied from and to the
# slots, rather than into a slot (``ShmArena.lease_output``); may follow the others.
COPIED_AG = "-copied-ag"
# ``<variant>-hooks``: with the per-step hooks of ``fsdp2lab train`` (the NaN guard's check, the
# preemption check's background all-reduce); the others run bare steps. Not for compute-only.
HOOKS = "-hooks"
# ``<variant>-hooks-gloo``: as ``-hooks``, with the preemption check in the background on gloo, as
# where the ranks share no memory (``runtime/preemption.py``).
HOOKS_GLOO = "-hooks-gloo"
DEFAULT = [
    n
    for n in VARIANTS
    if n
    not in ("compute-only", "fsdp2-auto-1m", "fsdp2-zero2", "fsdp2-auto-builtin", "fsdp2-auto-ring")
]
REFERENCES = ("ddp", "fsdp1", "fsdp1-root")
HELD = shm_collectives.ShmArena.HELD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT),
        help=f"of {', '.join(VARIANTS)}, each also with {DTENSOR_STEP}, {GLOO_BARRIER}, "
        f"{COPIED_AG}, {HOOKS} or {HOOKS_GLOO} (in this order)",
    )
    parser.add_argument(
        "--top-ops",
        type=int,
        default=0,
        metavar="K",
        help="then profile --steps steps of each variant; rank 0 prints the K ops of most self CPU",
    )
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    names = args.variants.split(",")
    host_memory.configure("cached")  # process-wide, as `fsdp2lab train` does by default
    runtime = distributed.init(launch_env.detect(), "auto")
    try:
        trainers, batches = {}, {}
        native_barrier = shm_collectives.SHM_BARRIER
        for name in names:
            flags = argparse.ArgumentParser()
            add_train_arguments(flags)
            base = name.removesuffix(HOOKS_GLOO).removesuffix(HOOKS).removesuffix(COPIED_AG)
            stem = base.removesuffix(GLOO_BARRIER)
            variant = VARIANTS[stem.removesuffix(DTENSOR_STEP)]
            cfg = config_from_args(
                flags.parse_args([*train_args, *variant, "--log-every-steps", "1000000"])
            )
            # An arena picks its barrier when it first maps its slots: in the warm-up.
            shm_collectives.SHM_BARRIER = native_barrier and stem == base
            if stem == "compute-only":
                trainers[name] = _one_rank(cfg, runtime)
            else:
                trainers[name] = Trainer(cfg, runtime, _hooks(name, runtime))
            if stem.endswith(DTENSOR_STEP):
                trainers[name].optimizer = build_optimizer(
                    trainers[name].model.parameters(), trainers[name].cfg, local_step=False
                )
            batches[name] = _batches(trainers[name])
            for _ in range(3):  # warm-up: lazy init, allocations
                _held(name)
                _step(trainers[name], batches[name])
            shm_collectives.SHM_BARRIER = native_barrier
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                _held(name)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    _step(trainers[name], batches[name])
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / args.steps)
        if runtime.is_main:
            _print(times, args.rounds)
        for name in names if args.top_ops else []:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    _step(trainers[name], batches[name])
            if runtime.is_main:
                table = prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=args.top_ops
                )
                print(f"\n{name}, {args.steps} steps:\n{table}", flush=True)
    finally:
        distributed.destroy()


def _one_rank(cfg, runtime) -> Trainer:
    """A one-rank ``Trainer`` in every rank, on a mesh of that rank alone, with the micro-batch
    the rank has in the multi-rank variants (as ``fsdp2lab bench``'s compute-only runs)."""
    world = runtime.world_size
    # The micro-batch of a data-parallel run of the same flags (the recipe's global batch too).
    micro = resolve(dataclasses.replace(cfg, strategy="ddp"), world).micro_batch
    cfg = dataclasses.replace(cfg, global_batch_size=None, batch_size=micro)
    alone = dataclasses.replace(runtime, rank=0, world_size=1, local_rank=0)

    def own_mesh(dims, device_type):
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=("rank", "dp_shard"))[
            "dp_shard"
        ]

    with mock.patch.object(trainer_module, "build_mesh", own_mesh):
        return Trainer(cfg, alone)


def _hooks(name: str, runtime) -> list:
    """The per-step hooks of ``fsdp2lab train`` for a ``-hooks`` variant; none otherwise."""
    if not name.endswith((HOOKS, HOOKS_GLOO)):
        return []
    preemption = Preemption(runtime, None)
    if name.endswith(HOOKS_GLOO):
        preemption.shared = False
    return [NanGuard(runtime, "stop"), preemption]


def _step(trainer: Trainer, batches) -> None:
    """A step as ``Trainer.fit`` takes it, without its step record."""
    trainer.train_step(batches)
    for hook in trainer.hooks:
        hook.after_step(trainer)


def _held(name: str) -> None:
    """How many all-gather outputs the variant's arena may hold in its slots."""
    shm_collectives.ShmArena.HELD = 0 if name.endswith(COPIED_AG) else HELD


def _batches(trainer: Trainer):
    epoch = 1
    while True:
        trainer.sampler.set_epoch(epoch, 0)
        yield from iter(trainer.loader)
        epoch += 1


def _print(times: dict[str, list[float]], rounds: int) -> None:
    refs = [n for n in REFERENCES if n in times]
    header = f"{'variant':14s} {'step ms':>9s} {'(min-max)':>15s}"
    if refs:
        header += f"   ratio to best of {','.join(refs)}"
    if "compute-only" in times:
        header += "   throughput of compute-only"
    print(header)
    for name, ts in times.items():
        line = f"{name:14s} {statistics.median(ts) * 1000:9.1f} ({min(ts) * 1000:.1f}-{max(ts) * 1000:.1f})"
        if refs:
            ratios = [ts[r] / min(times[n][r] for n in refs) for r in range(rounds)]
            line += f"   {_spread(ratios, '{:.2f}x')}"
        if "compute-only" in times:
            shares = [times["compute-only"][r] / ts[r] * 100 for r in range(rounds)]
            line += f"   {_spread(shares, '{:.0f}%')}"
        print(line, flush=True)


def _spread(values: list[float], fmt: str) -> str:
    """The median, and the range in brackets."""
    lo, hi = fmt.format(min(values)).rstrip("x%"), fmt.format(max(values))
    return f"{fmt.format(statistics.median(values))} ({lo}-{hi})"


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
