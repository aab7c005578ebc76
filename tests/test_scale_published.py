"""``fsdp2lab plan`` against published numbers (no GPU needed).

Calibration, not checked here: the allocator's factor ``ALLOCATOR_OVERHEAD``
(scale/estimate.py) was fitted to torchtitan's Table 1 memory (``TABLE_1``). The time model
(scale/timing.py) has no fitted constant: each comes from a datasheet or a published
microbenchmark (scale/gpus.py). Checked:

* Table 3 of the same file (128 GPUs): its memory, and its tokens/s as a ratio to Table 1's
  (what 16 nodes lose to one: the communication model);
* the tokens/s of Tables 1 and 3, eager and compiled, within 10%;
* torchtitan's first published FSDP2 figures, Llama 2 13B on 64 A100 80 GB: another model,
  GPU and sequence length;
* out of sample (runs that chose nothing), within 15%: torchtitan's Llama 3 8B and 70B on 64
  A100 80 GB.

Published memory is the allocator's max reserved: the plan is judged on its estimate of reserved
memory (scale/estimate.py's allocator model).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import runpy
import sys
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


def test_a_model_whose_communication_is_free_fails_that_check(runs, monkeypatch):
    """The negative control: with no latency and infinite bandwidth within and across nodes,
    128 GPUs train faster a GPU than 8 (1.007) and the check above fails."""
    import fsdp2lab.scale.estimate as estimate_module
    import fsdp2lab.scale.gpus as gpus_module

    gpu = gpus_module.GPUS["h100-96gb"]
    monkeypatch.setitem(estimate_module.LATENCY_S, "intra", 0.0)
    monkeypatch.setitem(estimate_module.LATENCY_S, "inter", 0.0)
    monkeypatch.setitem(
        gpus_module.GPUS, "h100-96gb", dataclasses.replace(gpu, intra_node_gbs=math.inf)
    )
    monkeypatch.setattr(sys.modules[__name__], "DEFAULT_INTER_NODE_GBS", math.inf)
    e = {n: _estimate(*runs[n], "h100-96gb") for n in runs}
    assert e[128]["tokens_per_s_per_gpu"] > e[8]["tokens_per_s_per_gpu"]
    with pytest.raises(AssertionError):
        test_what_16_nodes_lose_is_communication(runs)


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
    reason="the plan is 12-20% faster than published (docs/scale.md, 'Checked against "
    "published runs'): memory-bound kernels timed at a large copy's bandwidth, the A100's "
    "matmuls at a burst rate and the H100's uncapped (no sustained rate published for the A100 "
    "or at 500 W)",
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


# Out of sample: runs that chose nothing (no constant, nor --search's tie margin,
# scale/checked_rows.py). github.com/pytorch/torchtitan, docs/performance.md at commit
# 1ea476e9f24be439eda358aa864f45c1c37a8a88 (2024-04-24), "Llama 3 performance numbers": FSDP2 on
# 64 A100 80 GB, local batch 1, WPS (each rank's tokens a second, train.py at that commit). The
# rest from the configs at that commit (train_configs/llama3_8b.toml, llama3_70b.toml: its TP 8
# and batch 8 are the 2D loss curves'; torchtitan/models/llama/__init__.py,
# torchtitan/parallelisms/parallelize_llama.py): sequence 8192, vocabulary 128256, rope theta
# 500000, AdamW, bf16 parameters with fp32 reduction, no compile, no Float8, torch's cross-entropy
# on the fp32 logits; the 70B: dim 8192, 80 layers, 64 heads, 8 KV heads, SwiGLU 28672. Its
# "selective op" AC is Table 1's per-op policy (`op`), "selective layer" every other block
# (selective_ac_option's default, 2: `selective`). The network between hosts is not published.
# NeMo AutoModel's Llama 3 70B on 64 H100 trains with context parallelism, which the plan does not
# model: not checked (docs/scale.md).
LLAMA3_70B = 'dim=8192,n_layers=80,n_heads=64,n_kv_heads=8,hidden=28672,sac="none"'
OUT_OF_SAMPLE = {  # run: (--model-args, --activation-checkpointing, published tokens/s per GPU)
    "Llama 3 8B, 64 A100, per-op AC": ('sac="none"', "op", 2973),
    "Llama 3 8B, 64 A100, AC every other block": ('sac="none"', "selective", 2904),
    "Llama 3 70B, 64 A100, full AC": (LLAMA3_70B, "full", 331),
}
OUT_OF_SAMPLE_MISSED = {
    "Llama 3 70B, 64 A100, full AC": "the plan is 21% faster than published (docs/scale.md, "
    "'Out of sample'): 77% of its step is matmuls, timed at the A100's MAMF, a burst rate at "
    "the boost clock (no sustained matmul rate is published for the A100)",
}


@functools.cache
def out_of_sample_plan(row: str):
    """``row`` planned on 64 GPUs: LLAMA3_8B's flags, the later ones overriding."""
    model_args, ac, _ = OUT_OF_SAMPLE[row]
    flags = [*LLAMA3_8B, "--model-args", model_args, "--batch-size", "1",
             "--activation-checkpointing", ac]  # fmt: skip
    return _plan(flags, 64)


@functools.cache
def out_of_sample_run(row: str) -> tuple:
    """``row``'s plan and its simulation: once a session, shared by these tests and
    scripts/plan_time_table.py."""
    plan = out_of_sample_plan(row)
    return plan, simulate(plan)


def test_out_of_sample_models_are_the_published_ones():
    params = [out_of_sample_plan(row).params_total for row in OUT_OF_SAMPLE]
    assert params == [8_030_261_248, 8_030_261_248, 70_553_706_496]  # 8B, 8B, 70B


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            row,
            marks=pytest.mark.xfail(
                strict=True, raises=AssertionError, reason=OUT_OF_SAMPLE_MISSED[row]
            ),
        )
        if row in OUT_OF_SAMPLE_MISSED
        else row
        for row in OUT_OF_SAMPLE
    ],
)
def test_out_of_sample_tokens_per_s_within_15_percent(row):
    rate = _estimate(*out_of_sample_run(row), "a100")["tokens_per_s_per_gpu"]
    published = OUT_OF_SAMPLE[row][2]
    assert abs(rate - published) <= 0.15 * published, rate


def test_the_time_table_prints_the_out_of_sample_runs(monkeypatch, capsys):
    """``scripts/plan_time_table.py --out-of-sample`` (docs/scale.md's out-of-sample table): a
    row per run, with its published figure and the error."""
    script = Path(__file__).parents[1] / "scripts" / "plan_time_table.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--out-of-sample"])
    runpy.run_path(str(script), run_name="__main__")
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [cells[0].strip() for cells in rows] == list(OUT_OF_SAMPLE)
    for cells, (*_, published) in zip(rows, OUT_OF_SAMPLE.values(), strict=True):
        plan, measured = (float(c.replace(",", "")) for c in cells[1:3])
        assert measured == published
        # The cells are rounded: the error they give may differ from the printed one by a point.
        assert abs(float(cells[3].strip().rstrip("%")) / 100 - (plan / measured - 1)) <= 0.01
