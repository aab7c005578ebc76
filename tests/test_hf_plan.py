"""``fsdp2lab plan --model hf:PATH`` on a folder holding only ``config.json`` (no weights).

Llama 3.1 8B's config values: the plan builds the model from them on the meta device, and its
parameters and sharded state are the 8B model's (the same count as torchtitan's model code,
``tests/fixtures/llama3.py``); ``--tp 4`` computes and holds a quarter of the work. On a small
config, the attention's activations grow linearly with the sequence: the simulation takes the
flash kernel (output and log-sum-exp saved), not a path that materialises the score matrix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, run_cli
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.checked_rows import ROWS as CHECKED_ROWS
from fsdp2lab.scale.simulate import simulate

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False}  # fmt: skip
PARAMS_8B = 8_030_261_248


def config_folder(path, **values):
    transformers.LlamaConfig(**values).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    return path


def plan_json(folder, *flags: str) -> dict:
    proc = run_cli(["plan", "--model", f"hf:{folder}", *flags, "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_llama_8b_from_its_config_alone(tmp_path):
    """FSDP 8 against FSDP 2 x TP 4 (issue 37's flags). A TP 4 rank computes a quarter of FSDP 8's
    FLOPs: every matmul is split, and what TP leaves replicated (norms, rotary embeddings, the
    loss's elementwise work) has no matmul FLOPs. Its activations and temporaries at the step's
    peak are below a third of FSDP 8's: the loss is vocabulary-parallel, and the head's gradient
    (a unit of its own) is freed before the layers' backward."""
    folder = config_folder(tmp_path / "llama-3.1-8b", **LLAMA_8B)
    common = ["--seq-len", "8192", "--batch-size", "2", "--mixed-precision", "bf16",
              "--optimizer", "adamw", "--activation-checkpointing", "full", "--gpu", "h100-96gb",
              "--world-size", "8"]  # fmt: skip
    fsdp = plan_json(folder, *common)
    assert fsdp["params_total"] == PARAMS_8B
    assert fsdp["mesh"] == {"dp_shard": 8}
    # fp32 parameter and gradient, AdamW's two moments: 16 bytes a parameter, an eighth of them
    assert abs(fsdp["state_bytes_per_rank"] - 16 * PARAMS_8B / 8) < 1e-4 * 16 * PARAMS_8B / 8
    assert fsdp["fits"] is True
    tp = plan_json(folder, *common, "--tp", "4")
    assert tp["mesh"] == {"dp_shard": 2, "tp": 4}
    assert abs(tp["state_bytes_per_rank"] - fsdp["state_bytes_per_rank"]) < 1e-3 * 16e9 / 8
    assert set(tp["comm_bytes_per_step"]) == {"dp_shard", "tp"}
    (f,), (t,) = fsdp["roles"], tp["roles"]
    assert t["flops_per_step"] == pytest.approx(f["flops_per_step"] / 4, rel=1e-3)
    # each split matmul takes a quarter of the time, up to its last wave of tiles
    assert t["time"]["matmul_s"] == pytest.approx(f["time"]["matmul_s"] / 4, rel=0.03)
    ratio = sum(t["memory"][c] for c in ("activations", "temporaries")) / sum(
        f["memory"][c] for c in ("activations", "temporaries")
    )
    assert ratio < 1 / 3, (ratio, t["memory"], f["memory"])


def test_attention_memory_is_linear_in_the_sequence(tmp_path):
    """A materialised score matrix (batch x heads x seq x seq, fp32: 64 MiB a layer at 2,048)
    would more than triple the activations when the sequence doubles; flash attention doubles them."""
    folder = config_folder(tmp_path / "small", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           vocab_size=256, max_position_embeddings=8192)  # fmt: skip

    def activations(seq: int) -> int:
        flags = ["train", "--model", f"hf:{folder}", "--seq-len", str(seq), "--batch-size", "1"]
        plan = resolve(config_from_args(build_parser().parse_args(flags)), 2)
        return simulate(plan).peak_by_category["activations"]

    short, long = activations(2048), activations(4096)
    assert 1.8 * short <= long <= 2.3 * short, (short, long)


def test_pipeline_stages_are_rank_roles(tmp_path):
    """--pp 2 on a config-only folder: two roles, cut by the hf model's own pipeline (embedding on
    the first stage, the head on the last), each with its own sharded state."""
    folder = config_folder(tmp_path / "small", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                           vocab_size=256, max_position_embeddings=512,
                           tie_word_embeddings=False)  # fmt: skip
    r = plan_json(folder, "--seq-len", "64", "--batch-size", "4", "--world-size", "4", "--pp", "2")
    first, last = r["roles"]
    assert (first["stage"], last["stage"]) == (0, 1)
    assert first["modules"][0] == "model.embed_tokens" and "lm_head" not in first["modules"]
    assert last["modules"][-1] == "lm_head" and "model.embed_tokens" not in last["modules"]
    assert first["state_bytes"] != last["state_bytes"]
    assert r["comm_bytes_per_step"]["pp"] > 0


def test_training_keeps_no_key_value_cache_and_the_plan_sees_the_real_runs_attention(tmp_path):
    """transformers' causal LMs default to a key/value cache: in training it would hold every
    layer's keys and values for the whole step (and again for each layer activation
    checkpointing recomputes). The model fsdp2lab builds keeps none, its config (what the export
    writes) unchanged; the plan's fake run takes the real run's flash path (no mask built)."""
    import torch
    import torch.nn.functional as F

    folder = config_folder(tmp_path / "small", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=256, max_position_embeddings=512)  # fmt: skip
    flags = ["train", "--model", f"hf:{folder}", "--seq-len", "64", "--batch-size", "2"]
    plan = resolve(config_from_args(build_parser().parse_args(flags)), 2)
    model = plan.spec.build(plan.cfg).to_empty(device="cpu")
    out = model(torch.randint(0, 256, (2, 64)))
    assert out.past_key_values is None
    assert model.config.use_cache is True

    masks = []
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return real_sdpa(*args, attn_mask=attn_mask, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        model(torch.randint(0, 256, (2, 64)))
        simulate(plan)
    finally:
        F.scaled_dot_product_attention = real_sdpa
    assert len(masks) > 2 and all(m is None for m in masks)


# docs/speed.md's H200 runs (scripts/gpu_table.py: a Llama-3.2-1B shape, sequence 2048, batch 4,
# bf16, AdamW, one GPU, records every step): (layers, --compile, measured tokens/s).
H200_FLAGS = ["--seq-len", "2048", "--batch-size", "4", "--mixed-precision", "bf16",
              "--optimizer", "adamw"]  # fmt: skip
H200_ROWS = {
    "16 layers": (16, False, 44_113),
    "16 layers, compiled": (16, True, 48_415),
    "4 layers": (4, False, 102_861),
}


def h200_config(layers: int) -> dict:
    return dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=True)  # fmt: skip


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            row,
            marks=pytest.mark.xfail(
                strict=True,
                raises=AssertionError,
                reason="the plan is 12-21% faster than the H200 measured (docs/scale.md, "
                "'Checked against published runs')",
            ),
        )
        for row in H200_ROWS
    ],
)
def test_h200_rows_within_10_percent(tmp_path, row):
    layers, compile, measured = H200_ROWS[row]
    folder = config_folder(tmp_path / "llama-1b", **h200_config(layers))
    flags = [*H200_FLAGS, "--world-size", "1", "--gpu", "h200"]
    rate = plan_json(folder, *flags, *(["--compile"] if compile else []))["tokens_per_s_per_gpu"]
    assert abs(rate - measured) <= 0.10 * measured, rate


def test_the_time_table_plans_every_checked_run():
    """scripts/plan_time_table.py (docs/scale.md's table): one row per run the tests above and
    tests/test_scale_published.py check, each with its error and a step that adds up."""
    script = Path(__file__).parents[1] / "scripts" / "plan_time_table.py"
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()[2:]]
    assert len(rows) == 8, proc.stdout
    for cells in rows:
        plan, measured = (float(c.replace(",", "")) for c in cells[1:3])
        # scale.checked_rows (the error --search ties layouts by) holds each row as planned now.
        assert (plan, measured) == CHECKED_ROWS[cells[0].strip()], cells
        # The cells are rounded: the error they give may differ from the printed one by a point.
        assert abs(float(cells[3].strip().rstrip("%")) / 100 - (plan / measured - 1)) <= 0.01
