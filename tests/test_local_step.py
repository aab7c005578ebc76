"""The optimizer step on local shards (``parallel/local_step.py``) gives the DTensor step's bits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

SCRIPT = Path(__file__).parent / "scripts" / "check_local_step.py"
OPTIMIZERS = ("adadelta", "adam", "adamw", "adam-foreach", "sgd")


@pytest.mark.compat
def test_local_step_equals_the_dtensor_step_bit_for_bit(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), str(tmp_path)],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]
    # fsdp2lab's optimizers as the trainer builds them (and Adam's foreach implementation) against
    # the same optimizers stepping on the DTensors. 15 steps with uneven shards (rank 1 holds no row of the last layer); the first step creates
    # the state on the DTensors, and step 6, with a gradient laid out unlike its parameter, too.
    # After step 10 each optimizer loads a copy of its state dict (new state objects, as a resume
    # loads): the local view follows it.
    on_dtensors = [s in (0, 5) for s in range(15)]
    for report in reports:
        checks = report["checks"]
        for name in OPTIMIZERS:
            assert checks[name] == {
                "on_dtensors": on_dtensors,
                "params_equal": True,
                "state_equal": True,
                "state_keyed_by_params": True,
                "local_grads_released": True,
                "reloaded_new_state": True,
            }, (report["rank"], name)
        assert checks["rebinding"].startswith("Rebinding replaced its state 'buf' instead")
        assert checks["plain_params"] is False
