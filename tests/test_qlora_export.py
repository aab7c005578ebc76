"""QLoRA (``--quantize-base nf4``) export: ``--save-hf`` writes PEFT's adapter folder, which PEFT
loads on the bf16 base; ``--save-hf --merge`` merges the adapters into the source folder's bf16
weights, not their NF4 rounding: PEFT's own ``merge_and_unload()`` of that adapter folder on the
bf16 base, bit for bit. Two identical runs on 2 ranks (FSDP2, a tiny bf16 Llama whose projections
split into whole NF4 blocks over 2 ranks), one per folder; ``ckpt export`` of the first's
checkpoint (with and without ``--merge``) writes the same tensors as ``--save-hf``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import train
from fsdp2lab import cli

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("torchao")
safetensors_torch = pytest.importorskip("safetensors.torch")

RUN = ["--seq-len", "16", "--dataset", "synthetic", "--synthetic-size", "64", "--batch-size", "4",
       "--max-steps", "3", "--lora-rank", "4", "--quantize-base", "nf4", "--optimizer", "adamw",
       "--lr", "1e-2", "--progress", "off", "--nproc-per-node", "2"]  # fmt: skip


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> SimpleNamespace:
    from test_hf_pretrained import save_llama

    where = tmp_path_factory.mktemp("qlora-export")
    # bf16, untied; hidden 256: every projection splits into whole NF4 blocks over 2 ranks
    base = save_llama(where / "base", tied=False, dtype=torch.bfloat16, shard=None, hidden=256)
    model = ["--model", f"hf:{base}"]
    adapter = train(where, *model, *RUN, "--save-hf", str(where / "adapter"), "--ckpt-dir",
                    str(where / "ckpt"), name="adapter")  # fmt: skip
    merged = train(where, *model, *RUN, "--save-hf", str(where / "merged"), "--merge",
                   name="merged")  # fmt: skip
    assert adapter.step_losses == merged.step_losses  # the same training: the same adapters
    assert "merged into the source folder's weights, not the NF4 ones" in merged.stdout
    ckpt = where / "ckpt"
    assert cli.main(["ckpt", "export", str(ckpt), str(where / "exported")]) == 0
    assert cli.main(["ckpt", "export", str(ckpt), str(where / "exported-merged"), "--merge"]) == 0
    return SimpleNamespace(base=base, adapter=where / "adapter", merged=where / "merged",
                           exported=where / "exported", exported_merged=where / "exported-merged")  # fmt: skip


def batch() -> torch.Tensor:
    return torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_the_adapter_folder_loads_in_peft_on_the_bf16_base(run):
    config = json.loads((run.adapter / "adapter_config.json").read_text())
    assert (config["r"], config["peft_type"]) == (4, "LORA")
    base = transformers.AutoModelForCausalLM.from_pretrained(run.base)
    before = base(batch()).logits
    loaded = peft.PeftModel.from_pretrained(base, run.adapter)
    assert (loaded(batch()).logits - before).abs().max() > 0  # the adapters trained


@torch.no_grad()
def test_merge_is_peft_merge_and_unload_on_the_bf16_weights_bit_for_bit(run):
    from torchao.quantization import to_nf4

    base = transformers.AutoModelForCausalLM.from_pretrained(run.base)
    peft_model = peft.PeftModel.from_pretrained(base, run.adapter)
    expected = peft_model.merge_and_unload().state_dict()
    merged, source = tensors(run.merged), tensors(run.base)
    assert set(merged) == set(expected) and {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert [k for k in merged if not torch.equal(merged[k], expected[k])] == []
    changed = {k for k in merged if not torch.equal(merged[k], source[k])}
    assert changed and all(".self_attn." in k or ".mlp." in k for k in changed)
    # The control: the same merge into the NF4 weights the run computed with is another model.
    name = "model.layers.0.self_attn.q_proj.weight"
    rounded = to_nf4(source[name].float(), 64, 256).get_original_weight().to(torch.bfloat16)
    assert not torch.equal(rounded, source[name])
    delta = merged[name].float() - source[name].float()
    assert not torch.equal((rounded.float() + delta).to(torch.bfloat16), merged[name])


def test_ckpt_export_of_a_qlora_checkpoint_is_the_save_hf_folder(run):
    adapters = safetensors_torch.load_file(run.adapter / "adapter_model.safetensors")
    exported = safetensors_torch.load_file(run.exported / "adapter_model.safetensors")
    assert set(adapters) == set(exported)
    assert all(torch.equal(adapters[k], exported[k]) for k in adapters)
    merged, exported_merged = tensors(run.merged), tensors(run.exported_merged)
    assert set(merged) == set(exported_merged)
    assert all(torch.equal(merged[k], exported_merged[k]) for k in merged)
