"""Every rank's verdict at each preemption check, through shared memory and through gloo in the
background, where rank 1 alone receives SIGUSR1 before check 3; each rank writes OUT/rank-R.json.

Run under torchrun with 2 ranks on one host.
"""

import json
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.runtime.preemption import Preemption

dist.init_process_group("gloo")
rank = dist.get_rank()
runtime = Runtime(rank, dist.get_world_size(), rank, distributed.pick_device("cpu", rank), "gloo")
verdicts = {}
for name, shared in (("shared", None), ("background", False)):
    check = Preemption(runtime, None)
    check.shared = shared  # None: asked at the first check, as in training
    got = []
    for i in range(1, 6):
        if i == 3 and rank == 1:
            check._on_signal(signal.SIGUSR1, None)
        got.append(check._agreed(wait=False))
    verdicts[name] = {"verdicts": got, "shared": check.shared}
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(verdicts))
distributed.destroy()
distributed.exit_process(0)
