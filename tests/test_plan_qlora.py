"""``fsdp2lab plan --lora-rank R --quantize-base nf4``: QLoRA's frozen NF4 base planned.

A tiny gpt on 2 ranks, LoRA against QLoRA. Each rank's parameter bytes fall by what NF4 saves on
its shards, counted from torchao's own ``to_nf4`` of real weights split as FSDP2 splits them
(``torch.chunk``, NF4's own split): the plan's sharded state is made on fake tensors, this from
real ones. The report's whole NF4 bytes are the real ``to_nf4``'s. The planned step dequantizes
every NF4 weight in forward and again in backward: those memory-bound ops are in its trace. The
real trainer's steps on 1 CPU rank (the NF4 base left whole), 2 ranks and HSDP 2 x 2
(tests/scripts/scale_measure.py: the CPU allocator's events, gloo's records) match the plan as the
rows of tests/test_scale_plan.py do.
"""

from __future__ import annotations

import json

import pytest
import torch

from fsdp2lab import cli
from fsdp2lab.models import quantize
from fsdp2lab.scale.simulate import simulate
from test_scale_plan import ONE_RANK_NORM, measure, on_gloo, plan_of

pytestmark = [pytest.mark.hf]
pytest.importorskip("torchao")
pytest.importorskip("peft")

RANKS, LAYERS = 2, 2
TARGETS = "wq,wk,wv,wo,up,down"
# d_model 256: every projection holds a multiple of 2 x 16,384 values (two ranks' NF4 blocks).
MODEL = ["--model", "gpt", "--d-model", "256", "--n-layers", str(LAYERS), "--n-heads", "4",
         "--seq-len", "16", "--lora-rank", "4", "--lora-targets", TARGETS, "--optimizer",
         "adamw", "--max-grad-norm", "1.0"]  # fmt: skip
LORA = [*MODEL, "--batch-size", "4"]
QLORA = [*LORA, "--quantize-base", "nf4"]
SHAPES = {"wq": (256, 256), "wk": (256, 256), "wv": (256, 256), "wo": (256, 256),
          "up": (1024, 256), "down": (256, 1024)}  # fmt: skip


def stored_bytes(nf4) -> int:
    """The bytes of an NF4Tensor's inner tensors (packed values, scales, their factors and mean,
    the NF4 levels), as torchao holds them."""
    return sum(
        t.numel() * t.element_size()
        for t in (getattr(nf4, name) for name in nf4.__tensor_flatten__()[0])
    )


def real_nf4(shape) -> torch.Tensor:
    _, to_nf4 = quantize.nf4_api()
    return to_nf4(torch.randn(shape), quantize.BLOCK, quantize.SCALER_BLOCK)


def test_plan_of_qlora_cli(capsys):
    """``plan --quantize-base nf4`` reports the quantized base (its whole bytes those of the real
    ``to_nf4``) and plans it; ``--search`` with it is refused in one line, exit code 2."""
    assert cli.main(["plan", *QLORA, "--world-size", str(RANKS), "--json"]) == 0
    quantized = json.loads(capsys.readouterr().out)["lora"]["quantized"]
    assert quantized["weights"] == LAYERS * len(SHAPES)
    assert quantized["values"] == LAYERS * sum(h * w for h, w in SHAPES.values())
    assert quantized["bytes"] == LAYERS * sum(stored_bytes(real_nf4(s)) for s in SHAPES.values())
    search = [*MODEL, "--quantize-base", "nf4", "--global-batch-size", "8", "--search"]
    assert cli.main(["plan", *search, "--world-size", str(RANKS)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "fsdp2lab: error: fsdp2lab plan --search does not search --quantize-base layouts yet: "
        "plan one layout (fsdp2 or HSDP, the AC and units you choose) without --search"
    ]


def test_nf4_saving_and_dequantization_planned():
    """Per rank, QLoRA's parameter bytes are LoRA's less, for each base weight, its fp32 shard
    and plus its NF4 shard (the real ``to_nf4``'s first of ``torch.chunk``'s 2 parts); the step's
    peak is lower. Its trace holds the dequantization: memory-bound ops that write at least each
    NF4 weight's values in the compute dtype (bf16) in forward and again in backward."""
    flags = ["--mixed-precision", "bf16"]
    lora = simulate(plan_of(RANKS, [*LORA, *flags]), device_type="cpu")
    qlora = simulate(plan_of(RANKS, [*QLORA, *flags]), device_type="cpu")
    saving = LAYERS * sum(
        4 * h * w // RANKS - stored_bytes(torch.chunk(real_nf4((h, w)), RANKS)[0])
        for h, w in SHAPES.values()
    )
    assert lora.state["param_bytes"] - qlora.state["param_bytes"] == saving
    assert qlora.peak_bytes < lora.peak_bytes
    assert qlora.state["optimizer_state_bytes"] == lora.state["optimizer_state_bytes"]

    def memory_bound(run) -> int:
        return sum(op.bytes for op in run.ops if op.kind == "memory")

    values = LAYERS * sum(h * w for h, w in SHAPES.values())
    assert memory_bound(qlora) - memory_bound(lora) >= 2 * values * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "layout"),
    [(1, []), (RANKS, []), (4, ["--dp-replicate", "2"])],
    ids=["one-rank", "fsdp2", "hsdp-2x2"],
)
def test_plan_matches_real_qlora_run(ranks, layout):
    """The real trainer's QLoRA steps on CPU ranks against the plan, as
    ``test_scale_plan.test_plan_matches_real_trainer``'s rows: the optimizer state its first
    step makes (allocator bytes) and each step's collectives (gloo's records) equal; every
    measured step's peak the same, the plan's within 2% of it (pinned at 1.000, the gpt rows').
    On one rank FSDP2 leaves the NF4 base whole (``RunPlan.unsharded``)."""
    plan = plan_of(ranks, [*QLORA, *layout])
    assert bool(plan.unsharded) == (ranks == 1)
    planned = simulate(plan, device_type="cpu")
    (real,) = measure(ranks, [*QLORA, *layout])
    assert real["optimizer_state_bytes"] == planned.state["optimizer_state_bytes"]
    one_rank_norm = ONE_RANK_NORM if ranks == 1 else {}
    for step in real["steps"]:
        assert step["comm"] == {**on_gloo(plan, planned), **one_rank_norm}, step["comm"]
    peaks = {step["peak_bytes"] for step in real["steps"]}
    assert len(peaks) == 1, peaks
    assert 0.98 <= planned.peak_bytes / peaks.pop() <= 1.02
