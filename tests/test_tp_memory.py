"""Memory across TP degrees, planned and real: at ``--tp k`` (sequence parallelism, the loss
vocabulary-parallel) a rank's activations and the loss's temporaries are 1/k of TP 1's, but for
what stays whole on every tp rank: the sequence all-gathered into each attention, MLP and the
head (saved for their weights' gradients: ``2 x layers + 1`` tensors of batch x seq x d_model).

Measured by torch's ``FSDPMemTracker`` at a step's peak, on the real trainer (4 gloo CPU ranks,
``tests/scripts/tp_memory.py``) and in ``fsdp2lab plan``'s simulation of the same run, which
agree within 1%. The loss's chunk is scaled to the tiny model (64 tokens of 8,192 logits), as a
128,256-token vocabulary's is 130 tokens of a step's thousands.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.simulate import simulate
from fsdp2lab.training import loss

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TP_MEMORY = ROOT / "tests" / "scripts" / "tp_memory.py"
LAYERS, D, SEQ, BATCH, VOCAB = 2, 128, 128, 4, 8192
FLAGS = ["--model", "gpt", "--n-layers", str(LAYERS), "--d-model", str(D), "--n-heads", "4",
         "--seq-len", str(SEQ), "--vocab-size", str(VOCAB), "--batch-size", str(BATCH),
         "--synthetic-size", "512", "--progress", "off"]  # fmt: skip
CHUNK_BYTES = 64 * VOCAB * 4
WORLD = 4
WHOLE = (2 * LAYERS + 1) * BATCH * SEQ * D * 4  # the gathered inputs, fp32
CATEGORIES = ("activations", "temporaries")


def tp(k: int) -> list[str]:
    return ["--tp", str(k)] if k > 1 else []


def real(k: int) -> dict[str, int]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={WORLD}",
            str(TP_MEMORY),
            "--loss-chunk-bytes",
            str(CHUNK_BYTES),
            *FLAGS,
            *tp(k),
        ],  # fmt: skip
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["by_category"]


def planned(k: int) -> dict[str, int]:
    cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, *tp(k)]))
    return simulate(resolve(cfg, WORLD), device_type="cpu").peak_by_category


@pytest.fixture(scope="module")
def measured():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss, "CHUNK_BYTES", CHUNK_BYTES)
        plan = {k: planned(k) for k in (1, 2, 4)}
    return {"plan": plan, "real": {k: real(k) for k in (1, 2, 4)}}


@pytest.mark.parametrize("source", ["plan", "real"])
def test_tp_k_holds_a_kth_of_the_activations_and_loss_temporaries(measured, source):
    got = measured[source]
    sharded = got[1]["activations"] - WHOLE
    assert sharded > 10 * WHOLE, got[1]  # the check is about the sharded part
    for k in (2, 4):
        expected = WHOLE + sharded / k
        assert abs(got[k]["activations"] / expected - 1) < 0.1, (k, got[k], expected)
        expected = got[1]["temporaries"] / k
        assert abs(got[k]["temporaries"] / expected - 1) < 0.1, (k, got[k], expected)


def test_plan_is_the_real_runs_memory(measured):
    for k in (1, 2, 4):
        for category in CATEGORIES:
            plan, real = measured["plan"][k][category], measured["real"][k][category]
            assert abs(plan / real - 1) < 0.01, (k, category, plan, real)
