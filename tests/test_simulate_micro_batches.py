"""The plan's simulation runs a step's first, second and last micro-batch and counts the second
again for those between (``scale.simulate.alike_micro_batches``): every figure of each rank role
against a simulation that runs every micro-batch, with FSDP2 reducing once a step or every
micro-batch, with HSDP, and through a pipeline. The control: counting the second micro-batch only
once leaves the kernels, bytes, FLOPs and time short, and the comparison sees it."""

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


def test_the_comparison_sees_micro_batches_left_uncounted(monkeypatch):
    plan = _plan([*GPT, "--grad-accum-steps", "6"])
    monkeypatch.setattr(sim.StepCounter, "repeat", lambda self, mark, times: None)
    short = _figures(plan)[0]
    monkeypatch.undo()
    _every_micro_batch(monkeypatch)
    full = _figures(plan)[0]
    assert short[3] < full[3] and short[7] < full[7] and short[8] < full[8]  # FLOPs, ops, bytes
    assert short[9]["step_s"] < full[9]["step_s"]
