"""A Hugging Face model as your own model: ``--model examples/hf_llama.py:build``.

A small ``LlamaForCausalLM`` on the bytes of a text file: FSDP2 on 2 ranks (one unit per
``LlamaDecoderLayer``) against one process at every step; the meta build, ``to_empty`` and
per-module init against a model built normally (rotary ``inv_freq``, HF's ``_init_weights``,
tied weights); and a checkpoint that exports with its recorded config into ``from_pretrained``.
Needs the ``hf`` extra; ``.ci/run`` runs it as a stage of its own (``pytest -m hf``).
"""

from __future__ import annotations

import copy
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from conftest import assert_close_lists, train
from fsdp2lab import cli, consent
from fsdp2lab.config import TrainConfig
from fsdp2lab.models.materialize import build_on_meta, init_weights, to_empty
from fsdp2lab.plan import resolve

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"
STEPS = 20
WORDS = "the quick brown fox jumps over a lazy dog while ranks gather shards and reduce grads"


def _example():
    spec = importlib.util.spec_from_file_location("hf_llama_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = WORDS.split()
    lines = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(150)]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(lines)[:6000])
    return path


@pytest.fixture(scope="module")
def runs(text_file, tmp_path_factory) -> dict:
    """One process, and FSDP2 on 2 ranks (a checkpoint and --save-model at the last step)."""
    where = tmp_path_factory.mktemp("hf")
    common = ["--model", f"{EXAMPLE}:build", "--dataset", "text", "--text-file", str(text_file),
              "--seq-len", "32", "--vocab-size", "256", "--global-batch-size", "8",
              "--max-steps", str(STEPS), "--log-every-steps", "1", "--optimizer", "adam",
              "--lr", "0.003", "--dropout", "0", "--progress", "off"]  # fmt: skip
    single = train(where, *common, "--strategy", "single", name="single")
    fsdp2 = train(where, *common, "--strategy", "fsdp2", "--nproc-per-node", "2",
                  "--fsdp-units", "layer", "--ckpt-dir", str(where / "ckpt"),
                  "--save-model", str(where / "model.pt"), name="fsdp2")  # fmt: skip
    return {"single": single, "fsdp2": fsdp2, "dir": where}


def test_fsdp2_per_decoder_layer_matches_one_process_at_every_step(runs, text_file):
    single, fsdp2 = runs["single"], runs["fsdp2"]
    reference = single.step_losses
    assert len(reference) == STEPS and reference[-1] < reference[0] - 1.0, reference
    assert_close_lists(fsdp2.step_losses, reference, 1e-5)
    # Each rank holds half of the parameters: the model was sharded.
    (full,), per_rank = (run.events("step")[0]["param_bytes"] for run in (single, fsdp2))
    assert len(per_rank) == 2 and max(per_rank) <= full / 2 + 256, (full, per_rank)
    cfg = TrainConfig(model=f"{EXAMPLE}:build", dataset="text", text_file=str(text_file),
                      seq_len=32, vocab_size=256, strategy="fsdp2", fsdp_units="layer")  # fmt: skip
    with consent.granted():  # in-process: as the command line consents
        plan = resolve(cfg, 2)
    assert plan.units == ("model.layers.0", "model.layers.1")
    assert {type(plan.meta_model.get_submodule(u)).__name__ for u in plan.units} == {
        "LlamaDecoderLayer"
    }


def test_meta_build_to_empty_and_init_set_every_tensor_as_a_normal_build_would():
    build = _example().build
    fresh = build()  # built normally, on CPU
    reference = build_on_meta(build, real_buffers=True)
    assert all(p.is_meta for p in reference.parameters())

    def materialised(seed: int) -> torch.nn.Module:
        model = to_empty(copy.deepcopy(reference), "cpu")
        init_weights(model, reference, seed)
        return model

    model = materialised(0)
    # Non-persistent rotary buffers (not in any checkpoint): the values the model computed.
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    for name, buffer in buffers.items():
        assert torch.equal(buffer, fresh.get_buffer(name)), name
    # HF's _init_weights reached every tensor (materialize fills them with NaN first).
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert abs(param.std().item() - std) < 0.1 * std, (name, param.std().item())
            assert abs(param.mean().item()) < 0.1 * std, name
    # Tied weights stay tied, in the model and in the reference (which later builds copy).
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    again, other = materialised(0).state_dict(), materialised(1).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, other[
        "model.layers.0.mlp.up_proj.weight"])  # fmt: skip
    # The same forward as a normal build holding the same weights.
    fresh.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, fresh(tokens).logits)


def test_an_init_that_leaves_a_tensor_unset_is_an_error():
    class Partial(torch.nn.Module):
        """HF style: ``_init_weights(module)`` that knows Linear but not a raw Parameter."""

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))

        def _init_weights(self, module):
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
                torch.nn.init.zeros_(module.bias)

    reference = build_on_meta(Partial, real_buffers=True)
    model = to_empty(copy.deepcopy(reference), "cpu")
    with pytest.raises(ValueError, match=r"module <root> \(Partial\).*_init_weights.*scale"):
        init_weights(model, reference, 0)


def test_checkpoint_exports_with_its_recorded_config_into_from_pretrained(runs, tmp_path):
    where = runs["dir"]
    out = tmp_path / "hf"
    # No --hf-config: the run recorded the model's config in the checkpoint.
    args = ["ckpt", "export", str(where / "ckpt"), str(out)]
    assert cli.main(args) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # The weights the run ended with (--save-model, gathered from the shards).
    trained = _example().build()
    trained.load_state_dict(torch.load(where / "model.pt", weights_only=True))
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    final = trained.state_dict()
    assert all(torch.equal(v, final[k]) for k, v in loaded.state_dict().items())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    loaded.eval(), trained.eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, trained(tokens).logits)
