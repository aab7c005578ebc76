"""A step that writes no record makes the host wait for the device nowhere; a step record a fixed
few times (issue: GPU speed).

``tests/scripts/step_syncs.py`` counts, in each step of a real 2-rank run with the hooks a run
gets, the calls that on a GPU make the host wait for the device (``device_reads.HostWaits``: reads,
ops sized by device values, blocking copies, host values given the device, synchronizes). With
torch's fused AdamW the NaN guard drops a bad update on the device and is read with the step
records (``training/nan_guard.py``), and the records are read after their copy has landed
(``training/step_records.py``). Control: Adadelta has no fused kernel, so its guard reads the
verdict every step, and the count sees it; that read is the step's only wait (the trainer copies
no host value, such as the step's sample count, to the device). On a GPU the same steps run under
``torch.cuda.set_sync_debug_mode("error")`` (one rank, NCCL).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env
from skips import NO_GPU

SCRIPT = Path(__file__).parent / "scripts" / "step_syncs.py"
RUN = ["--model", "gpt", "--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--seq-len",
       "16", "--vocab-size", "64", "--dataset", "synthetic", "--batch-size", "2",
       "--max-steps", "16", "--log-every-steps", "5", "--progress", "on"]  # fmt: skip
AT_A_RECORD = 2  # the record's values and the NaN guard's verdicts, one read each


def reads_per_step(flags: list[str], ranks: int = 2) -> tuple[dict[int, int], list[int], dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
         str(SCRIPT), *RUN, *flags],  # fmt: skip
        env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    return {int(k): v for k, v in out["steps"].items()}, out["logged"], out["kinds"]


@pytest.mark.parametrize(
    "flags",
    [["--optimizer", "adamw"], ["--optimizer", "adamw", "--max-grad-norm", "1.0"]],
    ids=["adamw", "adamw-clipped"],
)
def test_no_host_read_between_step_records(flags):
    steps, logged, _ = reads_per_step(flags)
    assert sorted(steps) == list(range(1, 17)) and logged == [5, 10, 15, 16]
    assert {s: n for s, n in steps.items() if s not in logged} == dict.fromkeys(
        (s for s in steps if s not in logged), 0
    )
    assert all(steps[s] <= AT_A_RECORD for s in logged), steps


def test_control_an_optimizer_without_a_device_skip_reads_every_step_and_nothing_else():
    steps, logged, kinds = reads_per_step(["--optimizer", "adadelta"])
    assert all(n >= 1 for n in steps.values()), steps
    # the guard's verdict (one read); no host value copied to the device for the epoch's sums
    unlogged = {s: k for s, k in kinds.items() if int(s) not in logged}
    assert unlogged == dict.fromkeys(unlogged, {"read": 1}), kinds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("clip", [[], ["--max-grad-norm", "1.0"]], ids=["adamw", "adamw-clipped"])
def test_on_a_gpu_no_step_between_records_synchronizes(clip):
    steps, logged, _ = reads_per_step(["--device", "cuda", "--optimizer", "adamw", *clip], ranks=1)
    assert sorted(steps) == list(range(1, 17)) and logged == [5, 10, 15, 16]
