"""``--mixed-precision fp16`` (autocast or FSDP2's fp16 parameters, with ``torch.amp.GradScaler``).

- FSDP2 on 2 gloo ranks follows fp16 in one process within ``FP16_TOL`` at every one of 20 steps,
  and the fp32 curve within ``FP32_TOL``; it is not the fp32 curve (fp16 does compute in fp16).
  Bounds: fp16 keeps 11 significant bits (relative rounding 2^-11 = 4.9e-4 a value); over 20 steps
  of Adam the largest loss difference measured here is 2.8e-4 to fp16 in one process and 5.7e-4
  to fp32 (``pytest tests/test_fp16.py -s -k follows`` prints them); the bounds are about 3.5x
  that: 1e-3 and 2e-3.
- The scaler's state is in the checkpoint: a run whose NaN loss at step 3 was skipped (the scale
  backs off from 65536 to 32768) resumes at step 10 with that state and goes on bitwise (losses
  and loss scale); a resume given a fresh scaler's state instead fails the state check and logs
  another loss scale (the control).
- The NaN guard and the scaler: under fp16 the guard checks only the loss (a non-finite loss stops
  or skips the step as without fp16); gradient overflow is the scaler's own routine skip.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import read_metrics, run_variants, saved_checkpoint, train
from fsdp2lab.errors import TrainingFailed
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training.hooks import TrainState
from fsdp2lab.training.nan_guard import NanGuard

STEPS, SAVE_AT = 20, 10
FP16_TOL, FP32_TOL = 1e-3, 2e-3
COMMON = ["--model", "mlp", "--dataset", "synthetic", "--synthetic-size", "960", "--seed", "3",
          "--global-batch-size", "48", "--dropout", "0", "--optimizer", "adam",
          "--log-every-steps", "1", "--progress", "off", "--max-steps", str(STEPS)]  # fmt: skip
FP16 = ["--mixed-precision", "fp16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp16")
    ckpt = out / "ckpt"
    run_variants(out, 1, {
        "fp16-single": {"flags": [*FP16, "--strategy", "single"]},
        "fp32-single": {"flags": ["--strategy", "single"]},
    }, COMMON)  # fmt: skip
    run_variants(out, 2, {
        "fp16-fsdp2": {"flags": FP16},
        "skipped": {"flags": [*FP16, "--on-nan", "skip", "--ckpt-dir", str(ckpt),
                              "--ckpt-every-steps", str(SAVE_AT)],
                    "env": {"FSDP2LAB_NAN_AT": "1:3"}},
        "resumed": {"flags": [*FP16, "--resume", str(ckpt / f"step-{SAVE_AT}")],
                    "check": str(ckpt / f"step-{SAVE_AT}")},
        "fresh-scaler": {"flags": [*FP16, "--resume", str(ckpt / f"step-{SAVE_AT}")],
                         "check": str(ckpt / f"step-{SAVE_AT}"), "mutate": "scaler"},
    }, COMMON)  # fmt: skip
    return out


def steps(out: Path, name: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / f"{name}.jsonl") if r["event"] == "step"}


def losses(out: Path, name: str) -> list[float]:
    by_step = steps(out, name)
    assert sorted(by_step) == list(range(1, STEPS + 1)), name
    return [by_step[s]["loss"] for s in sorted(by_step)]


def mismatched(out: Path, name: str) -> list[str]:
    reports = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}.state.rank*.json"))]
    assert len(reports) == 2 and "scaler" in reports[0]["compared"]
    return sorted({k for r in reports for k in r["mismatched"]})


def test_fp16_on_two_ranks_follows_one_process_and_fp32(runs):
    fsdp2, single, fp32 = (losses(runs, n) for n in ("fp16-fsdp2", "fp16-single", "fp32-single"))
    to_single = max(abs(a - b) for a, b in zip(fsdp2, single, strict=True))
    to_fp32 = max(abs(a - b) for a, b in zip(fsdp2, fp32, strict=True))
    print(f"\nfp16 FSDP2 x2 - fp16 single: {to_single:.2e}; - fp32 single: {to_fp32:.2e}")
    assert to_single <= FP16_TOL and to_fp32 <= FP32_TOL, (fsdp2, single, fp32)
    assert fsdp2[-1] < 0.8 * fsdp2[0]  # it trains
    assert to_fp32 > 0 and losses(runs, "fp16-single") != fp32  # fp16 is not fp32
    assert {r["loss_scale"] for r in steps(runs, "fp16-fsdp2").values()} == {65536.0}


def test_the_scaler_state_is_saved_and_a_resume_goes_on_bitwise(runs):
    straight, resumed = steps(runs, "skipped"), steps(runs, "resumed")
    assert math.isnan(straight[3]["loss"]) and straight[2]["loss_scale"] == 65536.0
    assert straight[SAVE_AT]["loss_scale"] == 32768.0  # backed off at the skipped step
    saved = saved_checkpoint(runs / "ckpt" / f"step-{SAVE_AT}")
    assert saved["scaler"]["scale"] == 32768.0, saved["scaler"]
    assert mismatched(runs, "resumed") == []
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for s, record in resumed.items():
        assert (record["loss"], record["loss_scale"]) == (
            straight[s]["loss"],
            straight[s]["loss_scale"],
        ), s
    # Control: the same resume with a fresh scaler's state fails both checks.
    assert mismatched(runs, "fresh-scaler") == ["scaler"]
    fresh = steps(runs, "fresh-scaler")
    assert {r["loss_scale"] for r in fresh.values()} == {65536.0}


def _guard_input(loss: float, grad: float, scaler: bool):
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1.0, grad, 1.0])
    trainer = SimpleNamespace(
        device=torch.device("cpu"),
        scaler=torch.amp.GradScaler("cpu") if scaler else None,
        model=torch.nn.ParameterList([param]),
        state=TrainState(step=6),
        step_norm_checks=False,  # as the trainer sets it under fp16: its norm carries no loss
    )
    return trainer, torch.tensor(loss)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_under_fp16_the_guard_checks_the_loss_and_leaves_overflow_to_the_scaler(policy):
    guard = NanGuard(Runtime(0, 1, 0, torch.device("cpu"), "gloo"), policy)
    # An overflowed gradient with a finite loss: the scaler's routine skip, not the guard's.
    assert guard.before_optimizer_step(*_guard_input(1.0, math.inf, scaler=True)) is False
    # Without fp16 the same gradient is the guard's.
    for loss, grad, what in ((1.0, math.inf, "gradient"), (math.nan, 1.0, "loss")):
        for scaler in (False, True) if what == "loss" else (False,):
            trainer, loss_t = _guard_input(loss, grad, scaler)
            if policy == "skip":
                assert guard.before_optimizer_step(trainer, loss_t) is True
            else:
                with pytest.raises(TrainingFailed, match=f"non-finite {what} at step 7"):
                    guard.before_optimizer_step(trainer, loss_t)


@pytest.mark.drills  # a stopped run takes 20 s to end here: the fault drills' stage
def test_a_nan_loss_under_fp16_stops_the_run(tmp_path):
    run = train(tmp_path, *COMMON[:-2], "--max-steps", "5", *FP16, "--nproc-per-node", "2",
                env={"FSDP2LAB_NAN_AT": "0:4"}, check=False)  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.count("fsdp2lab: error: non-finite loss at step 4: training stopped") == 1
    assert sorted(r["step"] for r in run.events("step")) == [1, 2, 3]
