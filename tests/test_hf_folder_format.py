"""The Hugging Face folder an HF user expects: ``--save-hf`` and ``ckpt export`` keep a bf16
model's dtype (``--save-dtype`` chooses), ``--save-hf`` shards at ``--max-shard-size`` with an
index, every safetensors file carries ``{"format": "pt"}``, and ``from_pretrained`` loads the
trained weights, rounded to bf16. One training run of a tiny bf16 Llama serves every check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import train
from fsdp2lab import cli

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

VOCAB = 256


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny Llama saved in bf16, fine-tuned 2 steps in bf16 with ``--save-hf OUT`` in files of
    at most 20 KB, a checkpoint and the final (fp32) weights beside it."""
    tmp = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp / "llama")
    train(tmp, "--model", f"hf:{tmp / 'llama'}", "--max-steps", "2", "--mixed-precision", "bf16",
          "--save-hf", "out", "--max-shard-size", "20KB", "--ckpt-dir", "ckpt",
          "--save-model", "final.pt", "--seq-len", "16", "--synthetic-size", "32",
          "--global-batch-size", "4", "--optimizer", "adam", "--lr", "1e-2", "--progress", "off")  # fmt: skip
    return tmp


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def trained(run: Path) -> dict[str, torch.Tensor]:
    """The trained fp32 weights (``--save-model``)."""
    return torch.load(run / "final.pt", weights_only=True)


def test_save_hf_keeps_the_models_bf16_in_shards_with_their_index(run):
    out = run / "out"
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    assert all(p.stat().st_size <= 20_000 + 4096 for p in shards)  # the header aside
    saved, want = tensors(out), trained(run)
    assert saved.keys() == want.keys()
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert all(torch.equal(saved[k], want[k].to(torch.bfloat16)) for k in saved)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in saved.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_every_safetensors_file_says_format_pt(run, tmp_path):
    assert cli.main(["ckpt", "export", str(run / "ckpt"), str(tmp_path / "one.safetensors")]) == 0
    files = [*(run / "out").glob("*.safetensors"), tmp_path / "one.safetensors"]
    for file in files:
        with safetensors.safe_open(file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, file


def test_from_pretrained_logits_are_the_trained_models_within_bf16_rounding(run):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "out").eval()
    assert loaded.dtype == torch.bfloat16
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        run / "llama", dtype=torch.float32
    )
    reference.load_state_dict(trained(run))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    before = transformers.AutoModelForCausalLM.from_pretrained(run / "llama").float().eval()
    with torch.no_grad():
        got, want = loaded.float()(x).logits, reference.eval()(x).logits
        untrained = before(x).logits
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert (untrained - want).abs().max() > 5 * (got - want).abs().max()  # trained, told apart


def test_ckpt_export_keeps_bf16_and_save_dtype_chooses(run, tmp_path):
    ckpt, default, fp32 = run / "ckpt", tmp_path / "default", tmp_path / "fp32"
    assert cli.main(["ckpt", "export", str(ckpt), str(default)]) == 0
    assert cli.main(["ckpt", "export", str(ckpt), str(fp32), "--save-dtype", "fp32"]) == 0
    assert tensors(default).keys() == tensors(run / "out").keys()
    assert all(torch.equal(t, tensors(run / "out")[k]) for k, t in tensors(default).items())
    want = trained(run)
    assert all(torch.equal(t, want[k]) for k, t in tensors(fp32).items())
    for folder, dtype in ((default, "bfloat16"), (fp32, "float32")):
        assert json.loads((folder / "config.json").read_text())["dtype"] == dtype
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert str(loaded.dtype) == f"torch.{dtype}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--save-dtype", "bf16"], "--save-dtype needs --save-hf DIR"),
        (["train", "--max-shard-size", "1GB"], "--max-shard-size needs --save-hf DIR"),
        (["train", "--save-hf", "out", "--max-shard-size", "5XB"],
         "--max-shard-size: not a size: '5XB' (examples: 5GB, 500MB, 2GiB, 1000000)"),
        (["ckpt", "export", "CKPT", "out.pt", "--save-dtype", "bf16"],
         "--save-dtype goes with safetensors (OUT.safetensors or a folder)"),
    ],
    ids=["dtype-without-dir", "size-without-dir", "bad-size", "torch-export"],
)  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(run, args, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = [str(run / "ckpt") if a == "CKPT" else a for a in args]
    assert cli.main([*args, "--max-steps", "1"] if args[0] == "train" else args) == 2
    assert capsys.readouterr().err == f"fsdp2lab: error: {message}\n"


def test_files_written_whole_say_format_pt_and_save_dtype_casts_only_floats(tmp_path):
    """Integer tensors take the path that writes each file whole (torch's joining takes floating
    point only): its files say ``format: pt`` too; ``bf16`` casts every floating tensor, no other."""
    from fsdp2lab.checkpoint import safetensors_export as st_export
    from test_export_safetensors import _odd_tensors, _save

    weights = _odd_tensors()
    out = tmp_path / "out"
    st_export.export_safetensors(_save(tmp_path / "step-3", weights), out, None, 300, "bf16")
    saved = tensors(out)
    assert saved.keys() == weights.keys()
    for name, tensor in weights.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert saved[name].dtype == want.dtype and torch.equal(saved[name], want), name
    for file in out.glob("*.safetensors"):
        with safetensors.safe_open(file, framework="pt") as f:
            assert f.metadata()["format"] == "pt", file
