"""``ckpt export --format safetensors``: through DCP's Hugging Face storage, the Hugging Face
layout, memory."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp2lab import cli
from fsdp2lab.checkpoint import layout, targets
from fsdp2lab.checkpoint import safetensors_export as st_export
from fsdp2lab.checkpoint.state import MODEL, RUN
from fsdp2lab.config import parse_size
from fsdp2lab.errors import UsageError

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


def _save(path: Path, model_sd: dict[str, torch.Tensor], extra: dict | None = None) -> Path:
    """A complete checkpoint as the trainer lays it out: model tensors, run info, other state."""
    state = {MODEL: dict(model_sd), RUN: json.dumps({"model": "test"}), **(extra or {})}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    layout.mark_complete(path, {"step": 3, "contents": [MODEL, RUN, *(extra or {})]})
    return path


def _odd_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(17, 8, generator=g),
        "blocks.0.attn.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "blocks.0.norm.weight": torch.randn(8, generator=g).to(torch.float16),
        "blocks.0.scale": torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        "blocks.0.mask": torch.rand(3, 5, generator=g) > 0.5,
        "pos.index": torch.arange(7, dtype=torch.int64),
        "codes": torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),
        "empty": torch.zeros(0, 4),
        "head.weight": torch.randn(3, 8, generator=g).t(),  # not contiguous when saved
    }


def test_single_file_is_bitwise_the_checkpoint_model(tmp_path: Path, capsys):
    pytest.importorskip("safetensors")  # to read the file back (the export needs none)
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights = _odd_tensors()
    optim = {"optim": {"state.emb.weight.exp_avg": torch.ones(17, 8)}}
    ckpt = _save(tmp_path / "ckpts" / "step-3", weights, optim)
    out = tmp_path / "model.safetensors"
    assert cli.main(["ckpt", "export", str(ckpt.parent), str(out)]) == 0
    assert f"exported {len(weights)} tensors" in capsys.readouterr().out
    back = load_file(out)
    assert back.keys() == weights.keys()  # the model only, under its own names
    for name, tensor in weights.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    with safe_open(out, "pt") as f:  # what transformers checks, where a file says it
        assert (f.metadata() or {}).get("format", "pt") == "pt"
    assert not list(tmp_path.glob(".*tmp*"))


def test_folder_layout_shards_with_an_index(tmp_path: Path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    weights = _odd_tensors()
    ckpt = _save(tmp_path / "step-3", weights)
    out = tmp_path / "out"
    layout.mark_own(out, targets.MARK)
    (out / "model.safetensors").write_bytes(b"stale")  # from an earlier, unsharded export
    done = st_export.export_safetensors(ckpt, out, max_shard_size=300)
    index = json.loads((out / st_export.INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert {p.name for p in shards} == set(index["weight_map"].values())
    assert index["metadata"]["total_size"] == done.total_bytes
    back: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(shard)
        assert all(index["weight_map"][k] == shard.name for k in part)
        back.update(part)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)


def test_export_holds_at_most_the_largest_tensors_bytes_at_once(tmp_path: Path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    weights = {f"layers.{i}.weight": torch.randn(64, 16 * (i + 1), generator=g) for i in range(6)}
    ckpt = _save(tmp_path / "step-3", weights)
    real = st_export.load_tensor
    alive: list[weakref.ref] = []
    held: list[int] = []

    def spy(reader, entry):
        tensor = real(reader, entry)
        before = [r() for r in alive]
        held.append(sum(t.numel() * t.element_size() for t in before if t is not None))
        del before
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(st_export, "load_tensor", spy)
    st_export.export_safetensors(ckpt, tmp_path / "m.safetensors")
    assert len(held) == len(weights)
    # When each tensor is read, the tensors still held with it are at most the largest's bytes.
    sizes = [t.numel() * t.element_size() for t in weights.values()]
    assert max(h + s for h, s in zip(held, sizes, strict=True)) == max(sizes)
    assert held != [0] * len(weights)  # small tensors go to the writer together
    assert all(r() is None for r in alive)


def test_without_torchs_consolidation_each_file_is_written_whole_and_said(
    tmp_path: Path, monkeypatch, caplog
):
    """Tensors that are not floating point (or a torch that cannot consolidate by a mapping):
    the export holds one output file's tensors at a time, and says why in one line."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation

    from fsdp2lab.runtime import torch_compat

    weights = {f"layers.{i}.weight": torch.full((8, 4), float(i)) for i in range(6)}
    weights["layers.5.weight"] = torch.arange(32, dtype=torch.int64).reshape(8, 4)
    ckpt = _save(tmp_path / "step-3", weights)
    real = st_export.load_tensor
    alive: list[weakref.ref] = []
    held: list[int] = []

    def spy(reader, entry):
        before = [t for t in (r() for r in alive) if t is not None]
        held.append(len(before))
        del before
        tensor = real(reader, entry)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(st_export, "load_tensor", spy)
    monkeypatch.setattr(torch_compat, "_noticed", set())
    caplog.set_level("INFO")
    st_export.export_safetensors(ckpt, tmp_path / "int", max_shard_size=300)
    assert held == [0, 1, 0, 1, 0, 0]  # files of 2, 2, 1 tensors and the int64 one alone
    said = [r.getMessage() for r in caplog.records if "written whole" in r.getMessage()]
    assert said == [
        "fsdp2lab: torch's safetensors consolidation takes floating point only, not int64: each "
        "safetensors file is written whole"
    ]

    def by_file_count(input_dir, output_dir, num_threads=1): ...

    monkeypatch.setattr(consolidation, "consolidate_safetensors_files", by_file_count)
    del weights["layers.5.weight"]
    ckpt = _save(tmp_path / "floats" / "step-3", weights)
    held.clear()
    st_export.export_safetensors(ckpt, tmp_path / "floats.safetensors")
    assert held == [0, 1, 2, 3, 4]  # one file: its tensors together
    assert any("cannot consolidate safetensors shards" in r.getMessage() for r in caplog.records)
    from safetensors.torch import load_file

    back = load_file(tmp_path / "floats.safetensors")
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)


def test_sizes_and_refusals(tmp_path: Path, capsys, monkeypatch):
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000
    with pytest.raises(UsageError, match="not a size"):
        parse_size("lots")
    ckpt = _save(tmp_path / "step-3", {"w": torch.ones(2)})
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama"}))
    args = ["ckpt", "export", str(ckpt), str(tmp_path / "x.safetensors"), "--hf-config", str(hf)]
    assert cli.main(args) == 2
    assert "a Hugging Face export is a folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    args = ["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--hf-config", str(hf)]
    assert cli.main(args) == 2
    assert 'needs transformers: pip install -e ".[hf]"' in capsys.readouterr().err


# ---------------------------------------------------------------------------- Hugging Face
def _tiny_llama(tie: bool):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.hf
@pytest.mark.parametrize(("tie", "shard"), [(True, None), (False, None), (False, "20000")])
def test_hugging_face_layout_loads_with_from_pretrained(tmp_path: Path, monkeypatch, tie, shard):
    pytest.importorskip("safetensors")
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _tiny_llama(tie)
    sd = get_model_state_dict(model)
    # DCP stores tied weights twice (once per name); the export writes them once.
    ckpt = _save(tmp_path / "ckpts" / "step-3", sd)
    assert f"{MODEL}.lm_head.weight" in layout.open_checkpoint(ckpt).metadata.state_dict_metadata
    config = tmp_path / "hf.json"
    config.write_text(model.config.to_json_string())
    out = tmp_path / "hf"
    args = ["ckpt", "export", str(ckpt.parent), str(out), "--hf-config", str(config)]
    assert cli.main(args + (["--max-shard-size", shard] if shard else [])) == 0

    assert (out / "config.json").is_file()
    if shard:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        names = set(index["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:
            names = set(f.keys())
    assert ("lm_head.weight" in names) is not tie and "model.embed_tokens.weight" in names

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.dtype == torch.float32
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    assert torch.equal(want, got)


@pytest.mark.hf
def test_hugging_face_config_that_does_not_fit_is_refused(tmp_path: Path, capsys):
    model = _tiny_llama(tie=False)
    ckpt = _save(tmp_path / "step-3", {"w": torch.ones(2)})
    config = tmp_path / "hf.json"
    config.write_text(model.config.to_json_string())
    args = ["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--hf-config", str(config)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "does not fit the Hugging Face LlamaForCausalLM" in err and "Traceback" not in err
    assert not (tmp_path / "hf" / "config.json").exists()
