"""A training step dispatches the plain loop's ops, plus a bounded number that FSDP2, the NaN
guard and the step's bookkeeping need, each named by where it comes from (issue: GPU speed).

``tests/scripts/step_ops.py`` counts, with a ``TorchDispatchMode``, the ops of one step of the
real ``Trainer`` (FSDP2, one CPU rank, the hooks a run gets) and of the loop a user writes over
the same model (forward, ``F.cross_entropy``, backward, fused AdamW), filed by the part of the
step that issued them. On a GPU each op is at least one kernel launch: these counts are the
launch overhead fsdp2lab adds, which 2 CPU cores cannot time. docs/speed.md shows the table.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

SCRIPT = Path(__file__).parent / "scripts" / "step_ops.py"
MODEL = ["--model", "gpt", "--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--seq-len",
         "16", "--vocab-size", "64", "--dataset", "synthetic", "--batch-size", "2",
         "--optimizer", "adamw", "--progress", "off", "--dropout", "0"]  # fmt: skip
UNITS = 3  # two decoder layers and the root: --fsdp-units layer
# What each part may add to the plain loop's ops, at most: FSDP2's copy-in/out and hooks per
# unit; the NaN guard (one fused pass over the loss and the gradients, the flags); the trainer's
# bookkeeping (the batch's profiler range, the update's device flag, the epoch's sums).
BOUNDS = {"fsdp2": 40 * UNITS, "nan_guard": 20, "trainer": 16}
# A step that writes a record adds the gradient norm (with the loss's flag on its all-reduce)
# and the record's gathered row, sent to the host.
RECORD_BOUNDS = {**BOUNDS, "grad_norm": 20, "step_records": 8, "device_reads": 4}


# On 2 ranks, what FSDP2 may launch a step (views, allocations, profiler marks left out): each unit
# all-gathers twice (forward, and again in backward after resharding), 3 ops each (copy-in, the
# collective, copy-out), and reduce-scatters once, 4 ops (chunk-cat, the collective, the shard's
# copy, the 1/N divide).
FSDP2_LAUNCHES_PER_UNIT = 2 * 3 + 4


def step_ops(*launcher: str) -> dict:
    cmd = [sys.executable, *launcher, str(SCRIPT), *MODEL]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def ops() -> dict:
    return step_ops()


@pytest.fixture(scope="module")
def ops_2_ranks() -> dict:
    return step_ops("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def total(part: dict) -> int:
    return sum(part.values())


@pytest.mark.parametrize("which", ["trainer", "trainer_record"])
def test_the_model_loss_and_optimizer_ops_are_the_plain_loops(ops, which):
    plain, step = ops["plain"], ops[which]
    assert step["forward"] == plain["forward"] and step["backward"] == plain["backward"]
    # The plain loop's loss is F.cross_entropy's ops; its backward's seed (ones_like) is issued
    # where backward() is called, in the trainer for fsdp2lab.
    plain_loss = collections.Counter(plain["plain loop"]) - collections.Counter(
        {"aten::ones_like": 1}
    )
    assert step["loss"] == dict(plain_loss)
    # Fused AdamW's own ops, plus the step count's restore that a dropped update needs.
    optimizer = collections.Counter(plain["optimizer"]) + collections.Counter(
        {"aten::_foreach_sub_": 1}
    )
    assert step["optimizer"] == dict(optimizer)
    # So are their FLOPs: no extra matmul anywhere (FSDP2, the guard, the trainer have none).
    flops = {part: c["flops"] for part, c in step["cost"].items() if c["flops"]}
    plain_flops = {part: c["flops"] for part, c in plain["cost"].items() if c["flops"]}
    assert flops == {"forward": plain_flops["forward"], "backward": plain_flops["backward"]}


@pytest.mark.parametrize("which, bounds", [("trainer", BOUNDS), ("trainer_record", RECORD_BOUNDS)])
def test_every_extra_op_is_named_and_bounded(ops, which, bounds):
    step = ops[which]
    extra = {part: total(o) for part, o in step.items()
             if part not in ("forward", "backward", "loss", "optimizer", "cost")}  # fmt: skip
    assert set(extra) <= set(bounds), extra  # no op from an unnamed part (DTensor dispatch, ...)
    assert all(extra[part] <= bounds[part] for part in extra), extra
    assert extra["fsdp2"] > 0 and extra["nan_guard"] > 0  # the parts are seen at all


@pytest.mark.parametrize("which", ["trainer", "trainer_record"])
def test_on_2_ranks_a_rank_does_the_plain_loops_work_and_fsdp2_launches_10_ops_a_unit(
    ops, ops_2_ranks, which
):
    """Each of 2 ranks runs the model, the loss and the optimizer as one process's plain loop
    over its own micro-batch, and FSDP2 launches at most ``FSDP2_LAUNCHES_PER_UNIT`` ops per unit."""
    step, alone = ops_2_ranks[which], ops[which]
    assert all(step[part] == alone[part] for part in ("forward", "backward", "loss", "optimizer"))
    launches = {part: c["launches"] for part, c in step["cost"].items()
                if part not in ("forward", "backward", "loss", "optimizer")}  # fmt: skip
    assert 0 < launches.pop("fsdp2") <= FSDP2_LAUNCHES_PER_UNIT * UNITS
    bounds = RECORD_BOUNDS if which == "trainer_record" else BOUNDS
    assert set(launches) <= set(bounds), launches
    assert all(launches[part] <= bounds[part] for part in launches), launches
