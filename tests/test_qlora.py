"""``--quantize-base nf4`` (QLoRA): LoRA adapters on a frozen NF4 base, sharded by FSDP2.

16 steps of a tiny gpt with QLoRA on FSDP2 (2 ranks, gloo, with activation checkpointing) and
on HSDP (2 x 2) follow one process (``--strategy single``) within 1e-5; on every rank each decoder layer's linear weights are torchao NF4Tensors,
frozen, without gradient or optimizer state, bit for bit the same after training; every adapter of
every layer moved; the run's parameter bytes per rank are NF4's. What QLoRA does not support yet is refused in one line before any worker
starts (exit code 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_close_lists, cli_env, read_metrics, run_cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models import quantize
from fsdp2lab.plan import resolve

pytestmark = [pytest.mark.hf]
pytest.importorskip("torchao")
pytest.importorskip("peft")

SCRIPT = Path(__file__).parent / "scripts" / "qlora_state.py"
LAYERS = 2
TARGETS = ["wq", "wk", "wv", "wo", "up", "down"]
# d_model 256: every projection holds a multiple of 2 x 16,384 values (two ranks' NF4 blocks).
GPT = {"model": "gpt", "d_model": 256, "n_layers": LAYERS, "n_heads": 4, "seq_len": 16,
       "dataset": "synthetic", "lora_rank": 4, "lora_targets": ",".join(TARGETS),
       "quantize_base": "nf4"}  # fmt: skip
FLAGS = ["--model", "gpt", "--d-model", "256", "--n-layers", str(LAYERS), "--n-heads", "4",
         "--seq-len", "16", "--dataset", "synthetic", "--synthetic-size", "256",
         "--global-batch-size", "16", "--max-steps", "16", "--lora-rank", "4", "--lora-targets",
         ",".join(TARGETS), "--quantize-base", "nf4", "--optimizer", "adamw", "--lr", "1e-2",
         "--scheduler", "constant", "--log-every-steps", "1", "--progress", "off",
         "--dropout", "0"]  # fmt: skip


def qlora_run(tmp_path: Path, name: str, ranks: int, *extra: str) -> tuple[list, list, dict]:
    """(each rank's report from qlora_state.py, the step losses, the summary) of one run."""
    out, metrics = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(SCRIPT), str(out), *FLAGS, *extra,
           "--metrics-file", str(metrics)]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = read_metrics(metrics)
    losses = [r["loss"] for r in records if r["event"] == "step"]
    (summary,) = [r for r in records if r["event"] == "summary"]
    return json.loads(out.read_text()), losses, summary


def nf4_param_bytes(summary: dict, shards: int) -> int:
    """A rank's parameter bytes with the layers' projections (12 x 256 x 256 values a layer) in
    NF4: 4 bits a value, an int8 scale per 64 values, an fp32 factor per 64 x 256, and on each
    rank the fp32 mean and the 16 fp32 levels of each weight; the rest fp32, all split evenly."""
    quantized, weights = 12 * 256 * 256 * LAYERS, 6 * LAYERS
    nf4 = quantized // 2 + quantized // 64 + 4 * quantized // (64 * 256)
    rest = 4 * (summary["params_total"] - quantized)
    return (nf4 + rest) // shards + weights * 4 * (1 + 16)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[list, list, dict]:
    return qlora_run(tmp_path_factory.mktemp("single"), "single", 1, "--strategy", "single")


@pytest.mark.parametrize(
    ("ranks", "flags"),
    [(2, ["--activation-checkpointing", "full"]), (4, ["--dp-replicate", "2"])],
    ids=["fsdp2-ac", "hsdp-2x2"],
)
def test_sharded_follows_one_process_base_frozen_adapters_move(tmp_path, single, ranks, flags):
    one, one_losses, one_summary = single
    sharded, sharded_losses, summary = qlora_run(tmp_path, "sharded", ranks, *flags)
    assert len(sharded_losses) == 16
    assert_close_lists(sharded_losses, one_losses, 1e-5)
    assert one_summary["param_bytes"] == [nf4_param_bytes(one_summary, 1)]
    assert summary["param_bytes"] == [nf4_param_bytes(summary, 2)] * ranks  # dp_shard 2
    quantized = {f"blocks.{i}.{part}.{t}.base_layer.weight"
                 for i in range(LAYERS) for part, names in (("attn", TARGETS[:4]), ("mlp", TARGETS[4:]))
                 for t in names}  # fmt: skip
    for report in [*one, *sharded]:  # each rank's
        assert set(report["base"]) == quantized
        for name, facts in report["base"].items():
            assert facts == {"nf4": True, "frozen": True, "unchanged": True}, name
        adapters = report["adapters_moved"]
        assert len(adapters) == 2 * len(quantized)  # lora_A and lora_B of each
        assert all(adapters.values()), [n for n, moved in adapters.items() if not moved]


def plan(**flags):
    return resolve(TrainConfig(**{**GPT, **flags}), 2, "cpu")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"strategy": "ddp"}, "--strategy ddp"),
        ({"strategy": "fsdp1"}, "--strategy fsdp1"),
        ({"tp": 2}, "--tp"),
        ({"pp": 2}, "--pp"),
        ({"ckpt_dir": "ck"}, "--ckpt-dir"),
        ({"save_model": "m.pt"}, "--save-model"),
    ],
)
def test_refuses_what_it_does_not_support_yet(flags, named):
    with pytest.raises(UsageError, match=f"--quantize-base does not support {named}"):
        plan(**flags)


def test_refuses_weights_that_do_not_split_into_nf4_blocks():
    plan()  # d_model 256 splits over 2 ranks
    with pytest.raises(
        UsageError, match=r"blocks\.0\.attn\.wq\.base_layer\.weight 128 x 128 .* 32,768"
    ):
        plan(d_model=128)  # 16,384 values: one rank's whole NF4 block, not two


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    proc = run_cli(["train", *FLAGS, "--strategy", "ddp", "--nproc-per-node", "2"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fsdp2lab: error: --quantize-base does not support --strategy ddp yet: use --strategy "
        "fsdp2 (HSDP too) or single"
    ]
    assert not list(tmp_path.iterdir())


def test_a_hf_llama_quantizes_its_layers_projections_only(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    cfg = TrainConfig(model=f"hf:{tmp_path / 'llama'}", lora_rank=4, quantize_base="nf4")
    run = resolve(cfg, 2, "cpu")
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    assert [name for name, _ in quantize.base_linears(run.meta_model, run.units)] == [
        f"model.layers.{i}.{p}.base_layer" for i in range(2) for p in projections
    ]
    assert run.strategy.materialize_first  # quantized whole, then sharded
