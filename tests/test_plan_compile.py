"""``--compile`` in the plan's time model fuses only what is compiled: fsdp2lab compiles each
sharding unit (as torchtitan does), not the loss, so the loss's ops stay eager kernels, each
launched and each reading and writing its tensors."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import get_gpu
from fsdp2lab.scale.simulate import simulate
from fsdp2lab.scale.timing import fused

HW = Hardware(get_gpu("h100"), nproc_per_node=8, inter_node_gbs=25.0)
VOCAB = 131072  # the loss upcasts 512 tokens' logits a chunk: 256 MiB of fp32
CHUNK_LOGITS_BYTES = 512 * VOCAB * 4


@pytest.fixture(scope="module")
def compiled_run():
    argv = ["train", "--model", "gpt", "--n-layers", "2", "--d-model", "64", "--vocab-size",
            str(VOCAB), "--seq-len", "1024", "--batch-size", "2", "--mixed-precision", "bf16",
            "--optimizer", "adamw", "--compile"]  # fmt: skip
    plan = resolve(config_from_args(build_parser().parse_args(argv)), 2, "cuda")
    return plan, simulate(plan)


def _loss_ops(ops):
    """The memory-bound ops that read or write a chunk of fp32 logits: only the loss does."""
    return [
        op
        for op in ops
        if op.kind == "memory"
        and max((*op.read_bytes, *op.write_bytes), default=0) >= CHUNK_LOGITS_BYTES
    ]


def test_compile_leaves_the_loss_ops_unfused(compiled_run):
    _, run = compiled_run
    loss_ops = _loss_ops(run.ops)
    assert loss_ops and not any(op.fusable for op in loss_ops)
    kept = {id(op) for op in fused(run.ops)}
    assert all(id(op) in kept for op in loss_ops)


def test_compiled_step_pays_the_loss_eager(compiled_run):
    """Fusing the loss too (the old model) makes the compiled step shorter, by the loss's
    kernels it merges."""
    plan, run = compiled_run
    as_compiled = estimate(plan, run, HW)["time"]
    everything_fused = [
        dataclasses.replace(op, fusable=True) if op.kind == "memory" and not op.fsdp else op
        for op in run.ops
    ]
    loss_fused = estimate(plan, dataclasses.replace(run, ops=everything_fused), HW)["time"]
    assert as_compiled["kernels"] > loss_fused["kernels"]
    assert as_compiled["memory_bound_s"] > loss_fused["memory_bound_s"]
