"""Paired step-time comparison of strategies in one process group (for noisy, shared machines).

Every variant is a real ``Trainer`` (same model, data and ``train_step``) built in the same ranks;
rounds time ``--steps`` steps of each variant in turn (rotating the order), so load from other jobs
falls on all variants alike. Prints, per variant, the median step time and its ratio to the faster
of DDP and FSDP1 in the same round (median and range over rounds).

    torchrun --nproc-per-node 2 scripts/compare_step_time.py --rounds 10 -- \\
        --model cnn --dataset synthetic --progress off
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.parallel import shm_collectives
from fsdp2lab.runtime import distributed, host_memory, launch_env
from fsdp2lab.training.optim import build_optimizer
from fsdp2lab.training.trainer import Trainer

VARIANTS = {
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
DEFAULT = [
    n
    for n in VARIANTS
    if n not in ("fsdp2-auto-1m", "fsdp2-zero2", "fsdp2-auto-builtin", "fsdp2-auto-ring")
]
REFERENCES = ("ddp", "fsdp1", "fsdp1-root")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT),
        help=f"of {', '.join(VARIANTS)}, each also with {DTENSOR_STEP} and/or {GLOO_BARRIER}",
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
            stem = name.removesuffix(GLOO_BARRIER)
            variant = VARIANTS[stem.removesuffix(DTENSOR_STEP)]
            cfg = config_from_args(
                flags.parse_args([*train_args, *variant, "--log-every-steps", "1000000"])
            )
            # An arena picks its barrier when it first maps its slots: in the warm-up.
            shm_collectives.SHM_BARRIER = native_barrier and stem == name
            trainers[name] = Trainer(cfg, runtime)
            if stem.endswith(DTENSOR_STEP):
                trainers[name].optimizer = build_optimizer(
                    trainers[name].model.parameters(), trainers[name].cfg, local_step=False
                )
            batches[name] = _batches(trainers[name])
            for _ in range(3):  # warm-up: lazy init, allocations
                trainers[name].train_step(batches[name])
            shm_collectives.SHM_BARRIER = native_barrier
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    trainers[name].train_step(batches[name])
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / args.steps)
        if runtime.is_main:
            _print(times, args.rounds)
        for name in names if args.top_ops else []:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    trainers[name].train_step(batches[name])
            if runtime.is_main:
                table = prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=args.top_ops
                )
                print(f"\n{name}, {args.steps} steps:\n{table}", flush=True)
    finally:
        distributed.destroy()


def _batches(trainer: Trainer):
    epoch = 1
    while True:
        trainer.sampler.set_epoch(epoch, 0)
        yield from iter(trainer.loader)
        epoch += 1


def _print(times: dict[str, list[float]], rounds: int) -> None:
    refs = [n for n in REFERENCES if n in times]
    print(f"{'variant':14s} {'step ms':>9s} {'(min-max)':>15s}   ratio to best of {','.join(refs)}")
    for name, ts in times.items():
        line = f"{name:14s} {statistics.median(ts) * 1000:9.1f} ({min(ts) * 1000:.1f}-{max(ts) * 1000:.1f})"
        if refs:
            ratios = [ts[r] / min(times[n][r] for n in refs) for r in range(rounds)]
            line += f"   {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
