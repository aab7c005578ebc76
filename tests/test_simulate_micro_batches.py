"""The plan's simulation runs a step's first, second and last micro-batch and counts the second
again for those between (``scale.simulate.alike_micro_batches``), and runs a 1F1B pipeline stage's
warmup and three cycles, counting the second again for the cycles left out
(``scale.simulate.cycles_run``): every figure of each rank role against a simulation that runs
every micro-batch, with FSDP2 reducing once a step or every micro-batch, with HSDP, and through
pipelines of 2 and 4 stages (with accumulation, with full AC and parameters kept gathered). The
control: counting the second micro-batch only once leaves the kernels, bytes, FLOPs and time
short, and the comparison sees it."""

from __future__ import annotations

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale import simulate as sim
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import get_gpu

HW = Hardware(get_gpu("h100"), nproc_per_node=8, inter_node_gbs=25.0)
GPT = ["--model", "gpt", "--n-layers", "4", "--d-model", "64", "--seq-len", "64",
       "--mixed-precision", "bf16", "--optimizer", "adamw", "--batch-size", "12"]  # fmt: skip


def _figures(plan) -> list[tuple]:
    out = []
    for rank in sim.stage_ranks(plan):
        run = sim.simulate(plan, rank=rank)
        e = estimate(plan, run, HW)
        out.append((run.peak_bytes, run.peak_by_category, run.state, run.flops,
                    run.forward_flops, {d: dict(k) for d, k in run.comm.items()}, run.phases,
                    len(run.ops), sum(op.bytes for op in run.ops), e["time"]))  # fmt: skip
    return out


def _every_micro_batch(monkeypatch):
    monkeypatch.setattr(sim, "alike_micro_batches", lambda k, counts=(): iter(range(k)))
    monkeypatch.setattr(sim, "cycles_run", lambda plan, stage: plan.n_microbatches)


def _plan(argv: list[str], world: int = 4):
    return resolve(config_from_args(build_parser().parse_args(["train", *argv])), world, "cuda")


@pytest.mark.parametrize(
    "flags",
    [
        ["--grad-accum-steps", "6"],
        ["--grad-accum-steps", "4", "--grad-accum-reduce", "last", "--max-grad-norm", "1"],
        ["--grad-accum-steps", "6", "--dp-replicate", "2", "--activation-checkpointing", "full"],
        ["--grad-accum-steps", "4", "--pp", "2", "--pp-microbatches", "3"],
    ],
    ids=["fsdp", "reduce-last", "hsdp", "pp"],
)
def test_three_micro_batches_count_as_every_one(monkeypatch, flags):
    plan = _plan([*GPT, *flags])
    replayed = _figures(plan)
    _every_micro_batch(monkeypatch)
    assert replayed == _figures(plan)


@pytest.mark.parametrize(
    "flags, world",
    [
        (["--batch-size", "8", "--pp", "2", "--pp-microbatches", "8"], 4),
        (["--batch-size", "16", "--grad-accum-steps", "2", "--pp", "4", "--pp-microbatches", "8",
          "--activation-checkpointing", "full"], 4),
        (["--batch-size", "8", "--pp", "2", "--pp-microbatches", "8", "--dp-replicate", "1",
          "--reshard-after-forward", "false"], 4),
        (["--n-layers", "8", "--batch-size", "16", "--pp", "8", "--pp-microbatches", "16"], 8),
    ],
    ids=["2-stages", "4-stages-accumulation-full-ac", "2-stages-kept-gathered", "8-stages"],
)  # fmt: skip
def test_three_1f1b_cycles_count_as_every_one(monkeypatch, flags, world):
    """Alike but for what a left-out micro-batch's loss adds on the last stage: a 4-byte scalar
    held to the end of the step, and 12 bytes read and written stacking it with the others. Of
    the step time, the total and every kernel's time; not how the waits split between the host
    and the receives (a replayed cycle receives into the second cycle's buffer, so an op may
    wait on the other of two, for the same time)."""
    plan = _plan([*GPT, *flags], world)
    replayed = _figures(plan)
    left_out = [plan.n_microbatches - sim.cycles_run(plan, s) for s in range(plan.dims.pp)]
    assert min(left_out) > 0
    _every_micro_batch(monkeypatch)
    full = _figures(plan)
    k = plan.cfg.grad_accum_steps
    for stage, (a, b) in enumerate(zip(replayed, full, strict=True)):
        losses = left_out[stage] if stage == plan.dims.pp - 1 else 0
        assert 0 <= b[0] - a[0] <= 4 * losses  # peak
        assert {c: v for c, v in a[1].items() if c != "activations"} == {
            c: v for c, v in b[1].items() if c != "activations"
        }
        assert 0 <= b[1]["activations"] - a[1]["activations"] <= 4 * losses
        assert a[2:6] == b[2:6]  # state, FLOPs, forward FLOPs, collectives
        assert a[6][1:] == b[6][1:]  # the phases after the training step
        assert a[7] == b[7]  # kernels
        assert 0 <= b[8] - a[8] <= 12 * losses * k  # bytes
        for part in ("step_s", "compute_s", "matmul_s", "attention_s", "memory_bound_s"):
            assert a[9][part] == pytest.approx(b[9][part], rel=1e-5, abs=1e-15), part
        assert a[9]["kernels"] == b[9]["kernels"]


@pytest.mark.parametrize(
    "flags",
    [["--grad-accum-steps", "6"], ["--batch-size", "8", "--pp", "2", "--pp-microbatches", "8"]],
    ids=["accumulation", "1f1b"],
)
def test_the_comparison_sees_micro_batches_left_uncounted(monkeypatch, flags):
    plan = _plan([*GPT, *flags])
    monkeypatch.setattr(sim.StepCounter, "repeat", lambda self, mark, times: None)
    shorts = _figures(plan)
    monkeypatch.undo()
    _every_micro_batch(monkeypatch)
    for short, full in zip(shorts, _figures(plan), strict=True):
        assert short[3] < full[3] and short[7] < full[7] and short[8] < full[8]  # FLOPs, ops, bytes
        assert short[9]["step_s"] < full[9]["step_s"]
