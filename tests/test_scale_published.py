"""``fsdp2lab plan`` against published numbers it was not fitted to (no GPU needed).

Calibration, not checked here: ``ALLOCATOR_OVERHEAD`` and ``DEFAULT_EFFICIENCY``
(scale/estimate.py) were fitted to torchtitan's Table 1 (``CALIBRATION``), so the plan meets it
by construction. Every assert is out of sample:

* Table 3 of the same file (128 GPUs): its memory, and its tokens/s as a ratio to Table 1's
  (the fitted FLOP/s efficiency cancels; what is left is the plan's communication model);
* torchtitan's first published FSDP2 figures, Llama 2 13B on 64 A100 80 GB: another model,
  GPU and sequence length.

Published memory is the allocator's max reserved: the plan is judged on its estimate of reserved
memory (scale/estimate.py's allocator model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.scale.estimate import Hardware
from fsdp2lab.scale.gpus import DEFAULT_INTER_NODE_GBS, get_gpu
from fsdp2lab.scale.report import plan_report

pytestmark = pytest.mark.slow
FIXTURE = str(Path(__file__).parent / "fixtures" / "llama3.py")
GIB = 1024**3

# github.com/pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md at commit
# 820504e20d1149fbf0b98c567af24c4b0433b22d: Llama 3.1 8B, FSDP (no compile, no Float8) on H100
# 96 GB HBM2e, 8 a host, 400 Gb/s per GPU between hosts; local batch 2, sequence 8192, bf16
# parameters, per-op selective AC. (GiB max reserved, tokens/s per GPU)
CALIBRATION = {8: (82.4, 5762)}  # Table 1: fitted, never asserted
TABLE_3 = {128: (67.0, 5605)}
# torchtitan's model, activation checkpointing and loss (the whole logits upcast at once)
LLAMA3_8B = ["--model", f"{FIXTURE}:build", "--model-args", 'sac="none"', "--loss", f"{FIXTURE}:loss",
             "--vocab-size", "128256", "--seq-len", "8192", "--batch-size", "2",
             "--mixed-precision", "bf16", "--optimizer", "adamw",
             "--activation-checkpointing", "op"]  # fmt: skip

# github.com/pytorch/torchtitan, docs/performance.md at commit
# 6aac938438bfb4ec0cc05a2f4b51ac0194e01c78 (2024-04): "LLaMa 13B ... 64 A100 (80GB)", FSDP2,
# batch size 2, "selective op" AC: 1904 WPS (tokens/s per GPU). The run's config,
# train_configs/llama_13b.toml and torchtitan/models/llama/__init__.py at that commit: Llama 2
# 13B (dim 5120, 40 layers, 40 heads, SwiGLU 13824, vocabulary 32000), sequence 4096, AdamW,
# bf16 parameters, no compile. The network between hosts is not published: the plan's default.
LLAMA2_13B_A100_TOKENS_S = 1904
LLAMA2_13B = ["--model", f"{FIXTURE}:build", "--loss", f"{FIXTURE}:loss",
              "--model-args", 'vocab=32000,dim=5120,n_layers=40,n_heads=40,n_kv_heads=40,'
              'hidden=13824,max_seq=4096,theta=10000.0,sac="none"',
              "--vocab-size", "32000", "--seq-len", "4096", "--batch-size", "2",
              "--mixed-precision", "bf16", "--optimizer", "adamw",
              "--activation-checkpointing", "op"]  # fmt: skip


def _report(flags: list[str], gpus: int, gpu: str) -> dict:
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    hw = Hardware(get_gpu(gpu), 8, DEFAULT_INTER_NODE_GBS)  # 8 GPUs a node
    return plan_report(cfg, gpus, hw, alternatives=False)


@pytest.fixture(scope="module")
def plans() -> dict[int, dict]:
    return {n: _report(LLAMA3_8B, n, "h100-96gb") for n in (8, 128)}


def test_table3_memory_within_5_percent(plans):
    reserved = plans[128]["reserved_bytes_per_rank"] / GIB
    published = TABLE_3[128][0]
    assert abs(reserved - published) <= 0.05 * published, reserved


def test_tokens_per_s_128_vs_8_within_3_percent(plans):
    """Published 5,605 / 5,762 = 0.973: what 16 nodes lose to 1 (the fitted efficiency cancels)."""
    published = TABLE_3[128][1] / CALIBRATION[8][1]
    planned = plans[128]["tokens_per_s_per_gpu"] / plans[8]["tokens_per_s_per_gpu"]
    assert abs(planned - published) <= 0.03 * published, planned


def test_state_is_the_8b_model_sharded(plans):
    """16 bytes a parameter (fp32 parameter, gradient, AdamW's two moments), 1/N of them."""
    for gpus, plan in plans.items():
        assert plan["params_total"] == 8_030_261_248
        assert abs(plan["state_bytes_per_rank"] - 16 * 8_030_261_248 / gpus) < 1e-3 * 16e9 / gpus


@pytest.fixture(scope="module")
def llama2_13b() -> dict:
    return _report(LLAMA2_13B, 64, "a100")


def test_llama2_13b_is_the_published_model(llama2_13b):
    assert llama2_13b["params_total"] == 13_015_864_320  # Llama 2 13B


@pytest.mark.xfail(
    strict=True,
    reason="the plan gives 1,194 tokens/s (-37%): its one FLOP/s efficiency, fitted on H100, is "
    "0.38 of peak; torchtitan reports 53.8% MFU for this A100 run",
)
def test_llama2_13b_on_64_a100_tokens_per_s_within_10_percent(llama2_13b):
    rate = llama2_13b["tokens_per_s_per_gpu"]
    published = LLAMA2_13B_A100_TOKENS_S
    assert abs(rate - published) <= 0.10 * published, rate
