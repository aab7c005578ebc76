"""Every rank's verdict at each preemption check (gloo, in the background), where rank 1 alone
receives SIGUSR1 before check 3; each rank writes OUT/rank-R.json.

Run under torchrun with 2 ranks on one host.
"""

import json
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from fsdp2lab.runtime import distributed
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training.preemption import Preemption

dist.init_process_group("gloo")
rank = dist.get_rank()
runtime = Runtime(rank, dist.get_world_size(), rank, distributed.pick_device("cpu", rank), "gloo")
check = Preemption(runtime, None)
verdicts = []
for i in range(1, 6):
    if i == 3 and rank == 1:
        check._on_signal(signal.SIGUSR1, None)
    verdicts.append(check._agreed(wait=False))
verdicts.append(check._agreed(wait=True))  # the blocking check at an epoch's end
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(verdicts))
distributed.destroy()
distributed.exit_process(0)
