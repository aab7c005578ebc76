"""``--on-nan skip`` leaves the state untouched, on FSDP2 and DDP (2 gloo ranks).

A run with a NaN loss injected on rank 1 at step K saves a checkpoint after every step. After the
skipped step K the checkpoint's weights and optimizer state (Adam's step count included) equal
those after step K-1 bitwise (the update is dropped on the device, as a GradScaler drops one); the
data position is one global batch further on, and the schedule (cosine, stepped every step) one
step, as after any step. The steps after K equal, bitwise, a reference run that resumes the
checkpoint of step K-1 with its sampler and schedule one step on (batch K dropped,
tests/scripts/resume_matrix.py's ``drop-batch``).

Controls that the comparisons can fail: a normal step (K+1 against K) changes weights, optimizer
state and schedule; a run without the NaN (it trains batch K) differs from the skip run after K.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import read_metrics, run_variants, same_values, saved_checkpoint

K, STEPS, BATCH = 6, 12, 48
COMMON = ["--model", "mlp", "--dataset", "synthetic", "--synthetic-size", "960", "--seed", "3",
          "--global-batch-size", str(BATCH), "--dropout", "0", "--optimizer", "adam",
          "--scheduler", "cosine", "--log-every-steps", "1", "--progress", "off",
          "--max-steps", str(STEPS), "--on-nan", "skip"]  # fmt: skip
STRATEGIES = {"fsdp2": [], "ddp": ["--strategy", "ddp"]}


def losses(out: Path, name: str) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in read_metrics(out / f"{name}.jsonl") if r["event"] == "step"
    }


def trained_state(ckpt: dict) -> dict:
    """Weights, optimizer state and schedule of a checkpoint, flat."""
    flat = {f"model.{k}": v for k, v in ckpt["model"].items()}
    flat.update({f"optim.{k}": v for k, v in ckpt["optim"].items()})
    flat.update({f"scheduler.{k}": v for k, v in ckpt["scheduler"].items()})
    return flat


@pytest.fixture(scope="module", params=list(STRATEGIES))
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"skip-{request.param}")
    flags = STRATEGIES[request.param]
    ckpt = out / "ckpt"
    run_variants(out, 2, {
        "skip": {"flags": [*flags, "--ckpt-dir", str(ckpt), "--ckpt-every-steps", "1",
                           "--keep-last", "0"], "env": {"FSDP2LAB_NAN_AT": f"1:{K}"}},
        "reference": {"flags": [*flags, "--resume", str(ckpt / f"step-{K - 1}")],
                      "mutate": "drop-batch"},
        "no-nan": {"flags": flags},
    }, COMMON)  # fmt: skip
    return out


def test_a_skipped_step_leaves_weights_optimizer_and_schedule_bitwise(runs):
    before, skipped, after = (
        saved_checkpoint(runs / "ckpt" / f"step-{s}") for s in (K - 1, K, K + 1)
    )
    # Weights and optimizer state stay; the learning rate is the schedule's, which moved on.
    differ = same_values(trained_state(before), trained_state(skipped))
    assert differ and all(k.startswith("scheduler.") or k.endswith(".lr") for k in differ), differ
    assert skipped["scheduler"]["last_epoch"] == before["scheduler"]["last_epoch"] + 1
    steps = [v for k, v in trained_state(skipped).items() if k.endswith(".step")]
    assert steps and all(float(s) == K - 1 for s in steps), steps  # Adam's own count
    # The data position moves on one global batch, the step counts.
    moved = {k: skipped["train_state"][k] - before["train_state"][k] for k in before["train_state"]}
    assert moved == {"epoch": 0, "step": 1, "samples_seen": BATCH, "epoch_samples": BATCH}
    # Control: a normal step changes every part the comparison looks at.
    changed = same_values(trained_state(skipped), trained_state(after))
    for part in ("model.", "optim.", "scheduler."):
        assert any(k.startswith(part) for k in changed), (part, changed)


def test_the_steps_after_a_skip_equal_a_run_that_drops_that_batch(runs):
    skip, reference, no_nan = (losses(runs, n) for n in ("skip", "reference", "no-nan"))
    assert sorted(skip) == list(range(1, STEPS + 1)) and math.isnan(skip[K])
    assert sorted(reference) == list(range(K + 1, STEPS + 1))
    assert {s: skip[s] for s in reference} == reference  # bitwise
    # Control: the run that trained batch K agrees before K and differs after it.
    assert all(skip[s] == no_nan[s] for s in range(1, K))
    assert all(skip[s] != no_nan[s] for s in range(K + 1, STEPS + 1))
