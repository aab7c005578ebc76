"""``fsdp2lab plan`` against published numbers (no GPU needed).

Calibration, not checked here: the allocator's factor ``ALLOCATOR_OVERHEAD``
(scale/estimate.py) was fitted to torchtitan's Table 1 memory (``TABLE_1``). The time model
(scale/timing.py) has no fitted constant: each comes from a datasheet or a published
microbenchmark (scale/gpus.py). Checked:

* Table 3 of the same file (128 GPUs): its memory, and its tokens/s as a ratio to Table 1's
  (what 16 nodes lose to one: the communication model);
* the tokens/s of Tables 1 and 3, eager and compiled, within 10%;
* torchtitan's first published FSDP2 figures, Llama 2 13B on 64 A100 80 GB: another model,
  GPU and sequence length.

Published memory is the allocator's max reserved: the plan is judged on its estimate of reserved
memory (scale/estimate.py's allocator model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import DEFAULT_INTER_NODE_GBS, get_gpu
from fsdp2lab.scale.simulate import simulate

pytestmark = pytest.mark.slow
FIXTURE = str(Path(__file__).parent / "fixtures" / "llama3.py")
GIB = 1024**3

# github.com/pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md at commit
# 820504e20d1149fbf0b98c567af24c4b0433b22d: Llama 3.1 8B, FSDP (no compile, no Float8) on H100
# 96 GB HBM2e, 8 a host, 400 Gb/s per GPU between hosts; local batch 2, sequence 8192, bf16
# parameters, per-op selective AC. (GiB max reserved, tokens/s per GPU)
TABLE_1 = {8: (82.4, 5762)}  # its memory calibrated the allocator's factor: never asserted
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


def _plan(flags: list[str], gpus: int):
    return resolve(config_from_args(build_parser().parse_args(["train", *flags])), gpus, "cuda")


def _estimate(plan, run, gpu: str, compile: bool = False) -> dict:
    """The plan's figures for ``run`` on ``gpu`` (8 a node), eager or under ``--compile`` (the
    same ops, timed fused)."""
    if compile:
        plan = dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, compile=True))
    return estimate(plan, run, Hardware(get_gpu(gpu), 8, DEFAULT_INTER_NODE_GBS))


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple]:
    """Table 1 (8 GPUs) and Table 3 (128): each simulated once."""
    out = {}
    for n in (8, 128):
        plan = _plan(LLAMA3_8B, n)
        out[n] = (plan, simulate(plan))
    return out


def test_table3_memory_within_5_percent(runs):
    reserved = _estimate(*runs[128], "h100-96gb")["memory"]["reserved_bytes_estimate"] / GIB
    published = TABLE_3[128][0]
    assert abs(reserved - published) <= 0.05 * published, reserved


def test_tokens_per_s_128_vs_8_within_3_percent(runs):
    """Published 5,605 / 5,762 = 0.973: what 16 nodes lose to 1."""
    published = TABLE_3[128][1] / TABLE_1[8][1]
    rate = {n: _estimate(*runs[n], "h100-96gb")["tokens_per_s_per_gpu"] for n in runs}
    assert abs(rate[128] / rate[8] - published) <= 0.03 * published, rate


def test_what_16_nodes_lose_is_communication(runs):
    """Each rank computes the same in both runs (only the shards shrink): the 2.7% that 16 nodes
    lose to one is communication, and the plan must lose it, within a factor of 2, with more of
    its communication exposed at 128 GPUs. A model whose communication costs nothing gains
    instead (its smaller optimizer shards: 1.007) and fails here."""
    published_loss = 1 - TABLE_3[128][1] / TABLE_1[8][1]
    e = {n: _estimate(*runs[n], "h100-96gb") for n in runs}
    loss = 1 - e[128]["tokens_per_s_per_gpu"] / e[8]["tokens_per_s_per_gpu"]
    assert e[128]["time"]["exposed_comm_s"] > e[8]["time"]["exposed_comm_s"] > 0
    assert published_loss / 2 <= loss <= 2 * published_loss, loss


def test_state_is_the_8b_model_sharded(runs):
    """16 bytes a parameter (fp32 parameter, gradient, AdamW's two moments), 1/N of them."""
    for gpus, (plan, run) in runs.items():
        assert plan.params_total == 8_030_261_248
        assert abs(run.state_bytes - 16 * 8_030_261_248 / gpus) < 1e-3 * 16e9 / gpus


# Each published row, planned from its flags with no constant fitted to it: (GPUs, --compile,
# published tokens/s per GPU). The plan's error on each is in docs/scale.md's check table.
TIME_ROWS = {
    "table 1, FSDP": (8, False, 5762),
    "table 1, FSDP + compile": (8, True, 6667),
    "table 3, FSDP": (128, False, 5605),
    "table 3, FSDP + compile": (128, True, 6514),
}
MISSED = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the plan is 13-22% faster than published (docs/scale.md, 'Checked against "
    "published runs'): memory-bound kernels timed at a large copy's bandwidth, one attention "
    "rate forward and backward, the A100's matmuls at a burst rate and the H100's uncapped "
    "(no sustained rate published for the A100 or at 500 W)",
)


@pytest.mark.parametrize("row", [pytest.param(r, marks=MISSED) for r in TIME_ROWS])
def test_tokens_per_s_within_10_percent(runs, row):
    gpus, compile, published = TIME_ROWS[row]
    rate = _estimate(*runs[gpus], "h100-96gb", compile)["tokens_per_s_per_gpu"]
    assert abs(rate - published) <= 0.10 * published, rate


@pytest.fixture(scope="module")
def llama2_13b() -> tuple:
    plan = _plan(LLAMA2_13B, 64)
    return plan, simulate(plan)


def test_llama2_13b_is_the_published_model(llama2_13b):
    assert llama2_13b[0].params_total == 13_015_864_320  # Llama 2 13B


@MISSED
def test_llama2_13b_on_64_a100_tokens_per_s_within_10_percent(llama2_13b):
    rate = _estimate(*llama2_13b, "a100")["tokens_per_s_per_gpu"]
    published = LLAMA2_13B_A100_TOKENS_S
    assert abs(rate - published) <= 0.10 * published, rate
