"""What running in lockstep costs ranks that share a machine's cores, caches and memory bandwidth.

Every rank trains its own copy of the main job's ``cnn`` on its own batch, with no communication
in the step: in turns (rounds), either free-running, as compute only's side-by-side runs do, or
meeting at a barrier before each step, as every data-parallel step does at its collectives. Each
rank times the step itself (the barrier excluded) and prints the median of each turn's medians.
A lockstep step that is slower does the same work at the same moments as the other rank.

    torchrun --nproc-per-node 2 scripts/compare_lockstep.py --rounds 6 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2lab.models.mnist_cnn import Net
from fsdp2lab.runtime import distributed, host_memory, launch_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per turn")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    args = parser.parse_args()
    host_memory.configure("cached")
    runtime = distributed.init(launch_env.detect(), "cpu")
    torch.manual_seed(runtime.rank)
    model = Net(0.0, 0.0)  # the main job's recipe: dropout 0, Adam
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))

    def turn(steps: int, lockstep: bool) -> float:
        times = []
        for _ in range(steps):
            if lockstep:
                dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    turn(10, False)  # warm-up
    medians: dict[str, list[float]] = {"free-running": [], "lockstep": []}
    for _ in range(args.rounds):
        for name in medians:
            dist.barrier()
            medians[name].append(turn(args.steps, name == "lockstep"))
    line = ", ".join(f"{n} {statistics.median(m):.2f} ms" for n, m in medians.items())
    print(f"rank {runtime.rank}: step {line}", flush=True)
    distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
