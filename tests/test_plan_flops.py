"""FLOPs per rank in ``fsdp2lab plan``, as the rank's kernels compute them: under ``--tp`` a
matmul counts its shard of the weight and attention its local heads (not the DTensor op at its
global shape), checked against the real trainer's step counted with torch's own FLOP formulas
(``torch.utils.flop_counter``) on the ops its kernels run (``tests/scripts/step_flops.py``, which
uses nothing of the plan's counting).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, cli_env
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
STEP_FLOPS = ROOT / "tests" / "scripts" / "step_flops.py"
# 4 heads and an MLP of 4 x 64: every matmul and the attention split 1, 2 or 4 ways; no matmul
# is replicated across the tp ranks (the norms are, and have no FLOPs).
GPT = [*TINY, "--model", "gpt", "--n-layers", "2", "--d-model", "64", "--n-heads", "4",
       "--seq-len", "16", "--vocab-size", "256", "--batch-size", "2"]  # fmt: skip


def planned_flops(world: int, flags: list[str]) -> int:
    plan = resolve(config_from_args(build_parser().parse_args(["train", *flags])), world)
    return simulate(plan, device_type="cpu").flops


def real_flops(world: int, runs: list[list[str]]) -> list[list[int]]:
    """For each run's flags, each rank's FLOPs in one real ``Trainer.train_step`` (gloo, the runs
    one after another in the same ``world`` CPU ranks)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(STEP_FLOPS),
            json.dumps(runs),
        ],  # fmt: skip
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["flops"]


def tp(k: int) -> list[str]:
    return ["--tp", str(k)] if k > 1 else []


KS = (1, 2, 4)


def measured(runs: dict[int, list[str]]) -> dict[int, tuple[list[str], list[int]]]:
    """k -> (flags, each rank's real FLOPs), every k's step in one launch of 4 ranks."""
    real = real_flops(4, list(runs.values()))
    return {k: (flags, r) for (k, flags), r in zip(runs.items(), real, strict=True)}


def test_tp_rank_computes_its_share():
    """At TP k a rank of the tiny GPT computes 1/k of what a rank without TP computes for the
    same local batch (each TP group shares its batch): exactly, as nothing is replicated."""
    full = planned_flops(4, GPT)
    for k in (2, 4):
        assert planned_flops(4, [*GPT, *tp(k)]) * k == full, k


@pytest.fixture(scope="module")
def gpt_runs() -> dict:
    """The tiny GPT at TP 1, 2 and 4."""
    return measured({k: [*GPT, *tp(k)] for k in KS})


@pytest.mark.slow
@pytest.mark.parametrize("k", KS)
def test_plan_equals_real_step_gpt(gpt_runs, k):
    """The plan's FLOPs per rank equal a real step's on each rank, counted with torch's own FLOP
    formulas on the local ops (``step_flops.py``)."""
    flags, real = gpt_runs[k]
    assert real == [planned_flops(4, flags)] * 4


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory) -> dict:
    """A Llama from ``config.json`` alone at TP 1, 2 and 4, and with LoRA adapters."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("flops") / "llama"
    transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False,
    ).save_pretrained(folder)  # fmt: skip
    model = [*TINY, "--model", f"hf:{folder}", "--seq-len", "16", "--batch-size", "2"]
    return measured({**{k: [*model, *tp(k)] for k in KS}, "lora": [*model, "--lora-rank", "4"]})


@pytest.mark.hf
@pytest.mark.parametrize("k", KS)
def test_plan_equals_real_step_hf_llama(llama_runs, k):
    """A Llama from ``config.json`` alone, with the model's own TP plan."""
    flags, real = llama_runs[k]
    assert real == [planned_flops(4, flags)] * 4


@pytest.mark.hf
def test_plan_equals_real_step_lora(llama_runs, monkeypatch):
    """LoRA: the plan simulates the fused adapters the step runs (their in-place ``addmm_``
    among the matmuls) and no weight gradient for the frozen base."""
    from fsdp2lab.models import lora_fused

    calls = []
    fused = lora_fused.LoraLinearFunction.apply
    monkeypatch.setattr(
        lora_fused.LoraLinearFunction, "apply", lambda *a: calls.append(1) or fused(*a)
    )
    flags, real = llama_runs["lora"]
    assert real == [planned_flops(4, flags)] * 4
    assert calls, "the plan simulated PEFT's unfused path"
