"""LoRA (``--lora-rank``): export and memory.

One LoRA run on 2 ranks (FSDP2, fp32 compute, a bf16 base folder with a tokenizer), then
``ckpt export CKPT OUT`` (a PEFT adapter folder) and ``ckpt export CKPT OUT --merge``: PEFT loads
the adapter folder with the trained model's logits, and the merged folder is PEFT's own
``merge_and_unload()`` of it, bit for bit, in the base's dtype, with the tokenizer files. The
plan's per-rank state of a LoRA run equals a real run's, counted by ``tests/scripts/lora_state.py``
(not by the code the plan uses), and is the frozen base's shard plus 16 bytes an adapter weight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import cli_env, run_cli, train
from fsdp2lab import cli
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.report import lora_summary
from fsdp2lab.scale.simulate import simulate

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / "tests" / "scripts" / "lora_state.py"
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
COMMON = ["--seq-len", "16", "--synthetic-size", "64", "--batch-size", "4", "--progress", "off"]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def save_base(folder: Path) -> Path:
    """A tiny Llama in bf16 (untied, as Llama 3.1 8B) with a tokenizer."""
    from test_hf_tokens import make_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    make_tokenizer(folder)
    return folder


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> SimpleNamespace:
    where = tmp_path_factory.mktemp("lora")
    base = save_base(where / "base")
    ckpt, final = where / "ckpt", where / "final.pt"
    trained = train(where, "--model", f"hf:{base}", *LORA, "--nproc-per-node", "2",
                    "--max-steps", "3", "--optimizer", "adamw", "--lr", "1e-2",
                    "--ckpt-dir", str(ckpt), "--save-model", str(final), *COMMON)  # fmt: skip
    assert trained.summary["steps"] == 3
    adapter, merged = where / "adapter", where / "merged"
    assert cli.main(["ckpt", "export", str(ckpt), str(adapter)]) == 0
    assert cli.main(["ckpt", "export", str(ckpt), str(merged), "--merge"]) == 0
    return SimpleNamespace(where=where, base=base, ckpt=ckpt, final=final, adapter=adapter,
                           merged=merged)  # fmt: skip


def batch() -> torch.Tensor:
    return torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_adapter_folder_loads_in_peft_with_the_trained_models_logits(run):
    from fsdp2lab.models import lora

    assert sorted(p.name for p in run.adapter.iterdir()) == [
        ".fsdp2lab-export", "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    config = json.loads((run.adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # fmt: skip
    assert config["base_model_name_or_path"] == str(run.base)
    # fsdp2lab's own: the trained model of --save-model, in the model the run built
    cfg = resolve(config_from_args(build_parser().parse_args(
        ["train", "--model", f"hf:{run.base}", *LORA, *COMMON])), 1).cfg  # fmt: skip
    own = transformers.AutoModelForCausalLM.from_pretrained(run.base, dtype=torch.float32)
    own = lora.apply_lora(own, cfg)
    own.load_state_dict(torch.load(run.final, weights_only=True), strict=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(run.base, dtype=torch.float32)
    before = base(batch()).logits
    loaded = peft.PeftModel.from_pretrained(base, run.adapter)
    logits = loaded(batch()).logits
    assert (logits - before).abs().max() > 1e-3  # the adapters trained: not the base's logits
    assert (logits - own(batch()).logits).abs().max() <= 1e-5


@torch.no_grad()
def test_merge_is_peft_merge_and_unload_bit_for_bit_with_the_tokenizer(run):
    base = transformers.AutoModelForCausalLM.from_pretrained(run.base)  # its dtype: bf16
    assert base.dtype == torch.bfloat16
    expected = peft.PeftModel.from_pretrained(base, run.adapter).merge_and_unload()
    merged = folder_tensors(run.merged)
    reference = expected.state_dict()
    assert set(merged) == set(reference)
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    differ = [k for k in merged if not torch.equal(merged[k], reference[k])]
    assert not differ, differ[:3]
    originals = folder_tensors(run.base)
    changed = {k for k in merged if not torch.equal(merged[k], originals[k])}
    assert changed and all(".self_attn." in k or ".mlp." in k for k in changed)
    for name in TOKENIZER:
        assert (run.merged / name).read_bytes() == (run.base / name).read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run.merged)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded(batch()).logits, expected(batch()).logits)


def test_bad_exports_are_one_line_exit_2_and_write_nothing(run, capsys):
    cases = [
        ([str(run.where / "merged.pt"), "--merge"], "--merge writes a folder"),
        ([str(run.base), "--merge"], "it is the model folder the run started from"),
        ([str(run.where / "a"), "--hf-config", str(run.base / "config.json")], "--hf-config"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert cli.main(["ckpt", "export", str(run.ckpt), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    config = run.base / "config.json"
    original = config.read_bytes()
    config.write_bytes(original + b" ")  # another base: its fingerprint differs
    try:  # a new process, as a user runs it (this one has hashed the folder before)
        proc = run_cli(["ckpt", "export", str(run.ckpt), str(run.where / "a"), "--merge"])
    finally:
        config.write_bytes(original)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "changed since the run" in proc.stderr, proc.stderr
    assert not (run.where / "merged.pt").exists() and not (run.where / "a").exists()
    assert sorted(p.name for p in run.base.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER]
    )


def test_plan_state_is_a_real_runs_base_shard_plus_16_bytes_an_adapter_weight(tmp_path, run):
    """bf16 compute on a bf16 folder: the frozen base stays bf16 (2 bytes a weight, no gradient,
    no optimizer state); the adapters are fp32 with an fp32 gradient and AdamW's two moments (and
    its step count, 4 bytes a tensor)."""
    flags = ["--model", f"hf:{run.base}", *LORA, "--mixed-precision", "bf16",
             "--optimizer", "adamw", *COMMON]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(STATE), *flags],
        env=cli_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = resolve(config_from_args(build_parser().parse_args(["train", *flags])), 2, "cpu")
    role = simulate(plan, rank=0, device_type="cpu")
    real = ranks[0]
    assert role.state == {
        "param_bytes": real["frozen_param_bytes"] + real["adapter_param_bytes"],
        "grad_bytes": real["grad_bytes"],
        "optimizer_state_bytes": real["optimizer_state_bytes"],
    }
    adapters = [p for n, p in plan.meta_model.named_parameters() if "lora_" in n]
    n_adapter = sum(p.numel() for p in adapters)
    n_base = plan.params_total - n_adapter
    assert {p.dtype for n, p in plan.meta_model.named_parameters() if "lora_" not in n} == {
        torch.bfloat16}  # fmt: skip
    shown = lora_summary(plan)  # what the plan's report says of it
    assert (shown["adapter_params"], shown["base_params"]) == (n_adapter, n_base)
    assert (shown["rank"], shown["alpha"], shown["base_dtype"]) == (4, 8.0, "bfloat16")
    total = {k: sum(r[k] for r in ranks) for k in real}
    assert total["frozen_param_bytes"] == 2 * n_base
    assert total["adapter_param_bytes"] == total["grad_bytes"] == 4 * n_adapter
    assert total["optimizer_state_bytes"] == 8 * n_adapter + 4 * len(adapters) * len(ranks)
    assert total["frozen_with_grad"] == total["frozen_with_state"] == 0
