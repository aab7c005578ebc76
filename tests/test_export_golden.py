"""``ckpt export`` to safetensors writes what it wrote before it went through DCP's Hugging Face
storage: the same files, and in each the same tensors under the same names with the same dtypes,
shapes and bytes. ``fixtures/export_golden.json`` was written by the exporter that wrote the
safetensors format by hand, from these very checkpoints (seeded tensors)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from fsdp2lab.checkpoint import safetensors_export as st_export
from fsdp2lab.checkpoint.targets import MARK
from test_export_safetensors import _odd_tensors, _save

GOLDEN = Path(__file__).parent / "fixtures" / "export_golden.json"
LLAMA_CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}  # fmt: skip

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else tensor
    return hashlib.sha256(raw.numpy().tobytes() if tensor.numel() else b"").hexdigest()


def describe(out: Path) -> dict:
    """Each safetensors file of an export (a file, or a folder's) with its tensors' dtype, shape
    and bytes' sha256, and a folder's index weight map and other file names."""
    from safetensors import safe_open

    files = [out] if out.is_file() else sorted(out.glob("*.safetensors"))
    found: dict = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            found[file.name] = {
                k: [
                    str(f.get_tensor(k).dtype),
                    list(f.get_tensor(k).shape),
                    _digest(f.get_tensor(k)),
                ]
                for k in sorted(f.keys())  # noqa: SIM118 (not a mapping)
            }
    if out.is_dir():
        index = out / st_export.INDEX_FILE
        found["index"] = json.loads(index.read_text())["weight_map"] if index.exists() else None
        found["others"] = sorted(
            p.name for p in out.iterdir() if p.suffix != ".safetensors" and p.name != MARK
        )  # fsdp2lab's mark: tests/test_save_targets.py
    return found


def _floats() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layers.{i}.weight": torch.randn(8, 4 * (i + 1), generator=g) for i in range(5)}


def llama_weights(tied: bool) -> dict[str, torch.Tensor]:
    """Seeded tensors under a tiny Llama's names (the head equal to the embedding when tied)."""
    names = ["model.embed_tokens.weight"]
    shapes = {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (16, 16)), ("self_attn.k_proj", (8, 16)),
                            ("self_attn.v_proj", (8, 16)), ("self_attn.o_proj", (16, 16)),
                            ("mlp.gate_proj", (32, 16)), ("mlp.up_proj", (32, 16)),
                            ("mlp.down_proj", (16, 32))):  # fmt: skip
            names.append(f"{p}{name}.weight")
            shapes[f"{p}{name}.weight"] = shape
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names.append(f"{p}{norm}.weight")
            shapes[f"{p}{norm}.weight"] = (16,)
    names.append("model.norm.weight")
    g = torch.Generator().manual_seed(2)
    out = {n: torch.randn(shapes[n], generator=g) for n in names}
    out["lm_head.weight"] = (
        out["model.embed_tokens.weight"] if tied else torch.randn(64, 16, generator=g)
    )
    return out


def exports() -> dict[str, tuple[dict, str, dict]]:
    """name: (checkpoint model tensors, export target, export_safetensors keywords)."""
    return {
        "odd-file": (_odd_tensors(), "model.safetensors", {}),
        "odd-shards": (_odd_tensors(), "out", {"max_shard_size": 300}),
        "floats-file": (_floats(), "model.safetensors", {}),
        "floats-shards": (_floats(), "out", {"max_shard_size": 400}),
        "llama-tied": (llama_weights(True), "out", {"hf_config": {**LLAMA_CONFIG, "tie_word_embeddings": True}}),
        "llama-shards": (llama_weights(False), "out", {"hf_config": {**LLAMA_CONFIG, "tie_word_embeddings": False}, "max_shard_size": 4000}),
    }  # fmt: skip


CASES = [
    pytest.param(name, marks=[pytest.mark.hf] if name.startswith("llama") else [])
    for name in exports()
]


@pytest.mark.parametrize("name", CASES)
def test_exports_equal_the_hand_written_exporters(name, tmp_path):
    pytest.importorskip("safetensors")
    if name.startswith("llama"):
        pytest.importorskip("transformers")
    weights, target, kwargs = exports()[name]
    ckpt = _save(tmp_path / "step-3", weights)
    st_export.export_safetensors(ckpt, tmp_path / target, **kwargs)
    assert describe(tmp_path / target) == json.loads(GOLDEN.read_text())[name]
