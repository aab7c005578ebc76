"""``--model hf:PATH``: a pretrained Hugging Face folder built on meta, its weights read into the
sharded parameters. Loading is exact (``--max-steps 0 --save-model`` gives the folder's tensors
bit for bit on 1, 2 and 4 ranks, pipeline stages included; the first loss is transformers' own),
sharded, tensor- and pipeline-parallel training matches one process, and bad folders are one line
and exit code 2 before any worker starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_lists, read_metrics, run_cli, run_variants, train
from fsdp2lab import cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.data import synthetic
from fsdp2lab.data.sampler import epoch_order
from fsdp2lab.errors import UsageError
from fsdp2lab.plan import resolve

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SEQ = 16
SIZE = 256
COMMON = ["--seq-len", str(SEQ), "--synthetic-size", str(SIZE), "--progress", "off"]


def save_llama(
    folder: Path, *, tied: bool, dtype=torch.float32, shard: str | None = "20KB", hidden: int = 32
):
    """A tiny Llama saved as ``save_pretrained`` writes it (several files and their index);
    ``hidden`` 256 makes every projection split into whole NF4 blocks over 2 ranks (QLoRA)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def save_qwen2_bf16(folder: Path) -> Path:
    """Untied, biases in attention, bf16 files (into fp32 master weights), one file."""
    torch.manual_seed(1)
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("hf_models")
    return {
        "llama": save_llama(where / "llama", tied=True),
        "llama-untied": save_llama(where / "llama-untied", tied=False),
        "qwen2": save_qwen2_bf16(where / "qwen2"),
    }


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        out.update(safetensors_torch.load_file(file))
    return out


# id -> (folder, ranks, flags) of the layouts a folder is loaded into.
LAYOUTS = {
    "llama-single": ("llama", 1, ["--strategy", "single"]),
    "llama-fsdp2-2": ("llama", 2, ["--fsdp-units", "layer"]),
    "llama-hsdp-2x2": ("llama", 4, ["--fsdp-units", "layer", "--dp-replicate", "2"]),
    "qwen2-bf16-fsdp2-2": ("qwen2", 2, ["--fsdp-units", "layer"]),
    "qwen2-bf16-fsdp2-2-mixed-precision-bf16": ("qwen2", 2, ["--fsdp-units", "layer",
                                                             "--mixed-precision", "bf16"]),
    "qwen2-tp2": ("qwen2", 2, ["--tp", "2"]),
    "qwen2-fsdp2-tp-2x2": ("qwen2", 4, ["--tp", "2", "--fsdp-units", "layer"]),
    "llama-untied-pp2": ("llama-untied", 2, ["--pp", "2"]),
    "qwen2-pp-tp-2x2": ("qwen2", 4, ["--pp", "2", "--tp", "2"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def loaded(folders, tmp_path_factory) -> Path:
    """Every layout's ``--max-steps 0 --save-model OUT/<id>.pt`` (metrics: OUT/<id>.jsonl), the
    layouts of a world size one after another in the same ranks (tests/scripts/resume_matrix.py)."""
    out = tmp_path_factory.mktemp("loaded")
    for ranks in sorted({ranks for _, ranks, _ in LAYOUTS.values()}):
        variants = {
            name: {"flags": ["--model", f"hf:{folders[model]}", *flags,
                             "--save-model", str(out / f"{name}.pt")]}
            for name, (model, n, flags) in LAYOUTS.items()
            if n == ranks
        }  # fmt: skip
        run_variants(out, ranks, variants, ["--max-steps", "0", *COMMON])
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_max_steps_0_saves_the_folders_tensors_bit_for_bit(folders, loaded, name):
    model, ranks, _ = LAYOUTS[name]
    (summary,) = [r for r in read_metrics(loaded / f"{name}.jsonl") if r["event"] == "summary"]
    assert summary["steps"] == 0 and summary["world_size"] == ranks
    saved = torch.load(loaded / f"{name}.pt", weights_only=True)
    expected = folder_tensors(folders[model])
    assert set(expected) <= set(saved), sorted(set(expected) - set(saved))
    for key, tensor in expected.items():
        assert saved[key].dtype == torch.float32, key  # fp32 master weights
        assert torch.equal(saved[key], tensor.float()), key
    if model == "llama":  # tied: the head is the embedding (not in the files)
        assert "lm_head.weight" not in expected
        assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    elif model == "qwen2":  # bf16 files: the values are bf16 values, exactly
        assert all(torch.equal(saved[k], saved[k].bfloat16().float()) for k in expected)


def first_batch(folder: Path, seed: int = 1, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The first global batch of the synthetic tokens a run with COMMON trains on."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    train_set, _ = synthetic.tokens(vocab, SEQ, SIZE, SIZE // 4, seed)
    return train_set.__getitems__(epoch_order(len(train_set), seed, 1)[:batch].tolist())  # epoch 1


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_first_loss_is_cross_entropy_of_transformers_own_logits(folders, tmp_path, model):
    folder = folders[model]
    run = train(tmp_path, "--model", f"hf:{folder}", "--strategy", "single", "--max-steps", "1",
                "--log-every-steps", "1", "--global-batch-size", "64", *COMMON)  # fmt: skip
    x, y = first_batch(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = reference(x).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    (loss,) = run.step_losses
    assert abs(loss - expected) <= 1e-6, (loss, expected)


STEPS = 20
FIT = ["--max-steps", str(STEPS), "--log-every-steps", "1", "--optimizer", "adam", "--lr", "3e-3",
       "--global-batch-size", "16", *COMMON]  # fmt: skip


@pytest.fixture(scope="module")
def untied_reference(folders, tmp_path_factory) -> list[float]:
    """One process's losses on the untied Llama: what the TP and PP runs follow."""
    where = tmp_path_factory.mktemp("untied")
    single = train(where, "--model", f"hf:{folders['llama-untied']}", *FIT, "--strategy", "single",
                   name="single")  # fmt: skip
    reference = single.step_losses
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5, reference
    return reference


def test_fsdp2_and_hsdp_fine_tuning_match_one_process_at_every_step(folders, tmp_path):
    model = ["--model", f"hf:{folders['llama']}"]
    single = train(tmp_path, *model, *FIT, "--strategy", "single", name="single")
    reference = single.step_losses
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5, reference
    fsdp2 = train(tmp_path, *model, *FIT, "--nproc-per-node", "2", "--fsdp-units", "layer",
                  name="fsdp2")  # fmt: skip
    assert_close_lists(fsdp2.step_losses, reference, 1e-5)
    hsdp = train(tmp_path, *model, *FIT, "--nproc-per-node", "4", "--dp-replicate", "2",
                 "--fsdp-units", "layer", name="hsdp")  # fmt: skip
    assert_close_lists(hsdp.step_losses, reference, 1e-5)


def save_qwen3(folder: Path, layers: int = 2) -> Path:
    """Untied, with q/k norms over each head (on a TP rank's local heads)."""
    torch.manual_seed(3)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8,
                                      tie_word_embeddings=False)  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


SP_PLAN = "fsdp2lab: tensor parallel plan: fsdp2lab's for {} (sequence parallel norms and "


def test_sequence_parallel_tp_matches_one_process_at_every_step(
    folders, untied_reference, tmp_path
):
    """The Llama family's own plan (sequence parallelism, vocabulary-parallel loss): TP 2,
    FSDP 2 x TP 2 and PP 2 x TP 2 follow one process within 1e-5 over 20 steps, Qwen3 (per-head
    q/k norms) under TP 2 too."""
    model = ["--model", f"hf:{folders['llama-untied']}"]
    reference = untied_reference
    tp = train(tmp_path, *model, *FIT, "--nproc-per-node", "2", "--tp", "2", name="tp")
    assert SP_PLAN.format("llama") in tp.stdout
    assert_close_lists(tp.step_losses, reference, 1e-5)
    for name, flags in (("fsdp-tp", ["--fsdp-units", "layer"]), ("pp-tp", ["--pp", "2"])):
        got = train(tmp_path, *model, *FIT, "--nproc-per-node", "4", "--tp", "2", *flags,
                    name=name)  # fmt: skip
        assert_close_lists(got.step_losses, reference, 1e-5)
    qwen3 = ["--model", f"hf:{save_qwen3(tmp_path / 'qwen3')}"]
    single = train(tmp_path, *qwen3, *FIT, "--strategy", "single", name="qwen3-single")
    tp = train(tmp_path, *qwen3, *FIT, "--nproc-per-node", "2", "--tp", "2", name="qwen3-tp")
    assert SP_PLAN.format("qwen3") in tp.stdout
    assert_close_lists(tp.step_losses, single.step_losses, 1e-5)
    plan = resolve(TrainConfig(model=qwen3[1], seq_len=SEQ, tp=2), 2)
    styles = {k: type(v).__name__ for k, v in plan.spec.tp_plan(plan.meta_model).items()}
    assert styles["model.layers.1.input_layernorm"] == styles["model.norm"] == "SequenceParallel"
    assert styles["model.layers.1.self_attn"] == "PrepareModuleInput"
    assert styles["model.layers.1.self_attn.o_proj"] == "RowwiseParallel"
    # Per head, on the local heads; weights replicated, gradients summed over the tp ranks.
    assert styles["model.layers.1.self_attn.q_norm"] == "SequenceParallel"


def test_tp_from_the_models_own_plan_matches_one_process_at_every_step(tmp_path):
    """A model type outside the Llama family keeps its own ``base_model_tp_plan``, said in the
    log (Granite)."""
    model = ["--model", f"hf:{save_granite(tmp_path / 'granite')}"]
    single = train(tmp_path, *model, *FIT, "--strategy", "single", name="single")
    reference = single.step_losses
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5, reference
    tp = train(tmp_path, *model, *FIT, "--nproc-per-node", "2", "--tp", "2", name="tp")
    assert "fsdp2lab: tensor parallel plan: granite's own base_model_tp_plan" in tp.stdout
    assert_close_lists(tp.step_losses, reference, 1e-5)
    # Each rank holds about half of the parameters (norms are replicated).
    (full,), per_rank = (run.events("step")[0]["param_bytes"] for run in (single, tp))
    assert max(per_rank) < 0.6 * full, (full, per_rank)
    plan = resolve(TrainConfig(model=model[1], seq_len=SEQ, tp=2), 2)
    styles = {k: type(v).__name__ for k, v in plan.spec.tp_plan(plan.meta_model).items()}
    assert styles["model.layers.1.self_attn.q_proj"] == "ColwiseParallel"
    assert styles["model.layers.1.mlp.down_proj"] == "RowwiseParallel"
    assert styles["model.embed_tokens"] == styles["model.layers.0.self_attn.o_proj"]
    assert styles["lm_head"] == "ColwiseParallel" and len(styles) == 2 * 7 + 2


def test_tp_plans_fsdp2lab_cannot_follow_are_refused(folders, tmp_path):
    with pytest.raises(UsageError, match=r"^--tp: LlamaForCausalLM ties its output head to its "
                                         r"embedding, which its TP plan shards as separate "
                                         r"modules \(model.embed_tokens, lm_head\)"):  # fmt: skip
        resolve(TrainConfig(model=f"hf:{folders['llama']}", seq_len=SEQ, tp=2), 2)
    from fsdp2lab.models import hf

    qwen3 = save_qwen3(tmp_path / "qwen3", layers=1)
    model = hf.build_from_config(hf.read_config(qwen3))
    # Its own plan (what a type outside the Llama family would take) has a style not mapped.
    with pytest.raises(UsageError, match=r"^--tp: Qwen3ForCausalLM's TP plan uses style "
                                         r"'replicated_with_grad_allreduce' \(e.g. "
                                         r"model.layers.0.self_attn.q_norm\), which fsdp2lab does "
                                         r"not map"):  # fmt: skip
        hf.tp_plan(model)
    with pytest.raises(UsageError, match=r"--tp 3 must divide .* num_attention_heads 4"):
        resolve(TrainConfig(model=f"hf:{folders['qwen2']}", seq_len=SEQ, tp=3), 3)


def test_pipeline_fine_tuning_matches_one_process_at_every_step(
    folders, untied_reference, tmp_path
):
    model = ["--model", f"hf:{folders['llama-untied']}"]
    reference = untied_reference
    pp = train(tmp_path, *model, *FIT, "--nproc-per-node", "2", "--pp", "2", "--pp-schedule",
               "1f1b", name="pp")  # fmt: skip
    assert "stage 0 [model.embed_tokens, model.layers.0]; stage 1 [model.layers.1, model.norm, " \
           "lm_head]" in pp.stderr + pp.stdout  # fmt: skip
    assert_close_lists(pp.step_losses, reference, 1e-5)
    pp_fsdp2 = train(tmp_path, *model, *FIT, "--nproc-per-node", "4", "--pp", "2",
                     "--fsdp-units", "layer", name="pp-fsdp2")  # fmt: skip
    assert pp_fsdp2.summary["mesh"]["names"] == ["pp", "dp_shard"]
    assert_close_lists(pp_fsdp2.step_losses, reference, 1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2-sliding"])
def test_pipeline_stages_run_in_order_are_the_models_forward(kind):
    """Every split of a 4-layer model; Qwen2 with sliding-window attention on layers 2 and 3
    (``config.layer_types``): a later stage's layers keep their own attention masks."""
    import copy

    from fsdp2lab.models import hf
    from fsdp2lab.models.spec import ModelSpec, infer_units
    from fsdp2lab.parallel import pp

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=300, **sizes)
    else:
        config = transformers.Qwen2Config(vocab_size=256, use_sliding_window=True,
                                          sliding_window=4, max_window_layers=2, **sizes)  # fmt: skip
        assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    model = hf.build_from_config(config).eval()
    spec = ModelSpec(name=kind, build=None, task="lm", input_shape=None, datasets=(),
                     default_dataset="synthetic", pipeline=hf.pipeline,
                     pipeline_stage=hf.pipeline_stage)  # fmt: skip
    x = torch.randint(0, config.vocab_size, (3, SEQ))
    with torch.no_grad():
        expected = model(x).logits
    units = tuple(infer_units(model))
    for n in range(2, 5):
        stages = pp.split(spec, model, units, n)
        y, names = x, []
        for i in range(n):
            stage = pp.make_stage(spec, copy.deepcopy(model), stages, i)
            names += [name for name, _ in stage.named_parameters()]
            with torch.no_grad():
                y = stage(y)
            assert y.shape[-1] == (config.vocab_size if i == n - 1 else config.hidden_size)
        assert names == [name for name, _ in model.named_parameters()]  # same FQNs, each once
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


def save_granite(folder: Path) -> Path:
    """Granite: its base model multiplies the embeddings by ``embedding_multiplier``, also when
    given ``inputs_embeds`` (a later stage would multiply them again)."""
    torch.manual_seed(2)
    config = transformers.GraniteConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.GraniteForCausalLM(config).save_pretrained(folder)
    return folder


def test_pipeline_refusals_are_one_line_and_exit_2(folders, tmp_path):
    """A head tied to the embedding (stages 0 and 1 would each hold the weight, and nothing would
    sum its two gradients), and a model type whose base forward is not checked to run a later
    stage unchanged: one line from the launcher, no worker started."""
    tied = (
        f"fsdp2lab: error: --pp: model 'hf:{folders['llama']}' ties lm_head.weight to "
        "model.embed_tokens.weight (one parameter), which would be split between stages 0 and 1 "
        "with nothing to sum its gradients; use a model without tied weights "
        "(tie_word_embeddings false)\n"
    )
    granite = (
        "fsdp2lab: error: --pp: fsdp2lab splits Hugging Face models of type llama, mistral, "
        "qwen2, qwen3 into pipeline stages, not 'granite' (a later stage runs the base model's "
        "forward on hidden states, checked to be the model's own for these types only)\n"
    )
    for folder, message in (
        (folders["llama"], tied),
        (save_granite(tmp_path / "granite"), granite),
    ):
        proc = run_cli(["train", "--model", f"hf:{folder}", "--nproc-per-node", "2", "--pp", "2",
                        *COMMON], cwd=tmp_path)  # fmt: skip
        assert (proc.returncode, proc.stderr) == (2, message), proc.stderr
    untied = f"hf:{folders['llama-untied']}"
    with pytest.raises(UsageError, match=r"^--strategy model-parallel: model .* is split only "
                                         r"into pipeline stages \(--pp with --strategy fsdp2\)$"):  # fmt: skip
        resolve(TrainConfig(model=untied, seq_len=SEQ, strategy="model-parallel"), 1)


def test_a_config_only_folder_builds_the_model_with_the_seeded_init(folders, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(folders["llama"] / "config.json", folder)
    plan = resolve(TrainConfig(model=f"hf:{folder}", seq_len=SEQ), 1)
    assert plan.spec.load_weights is None
    assert plan.cfg.vocab_size == 300  # the config's, not the flag's default
    assert type(plan.meta_model).__name__ == "LlamaForCausalLM"
    assert plan.units == ("model.layers.0", "model.layers.1")
    first = train(tmp_path, "--model", f"hf:{folder}", "--strategy", "single", "--max-steps", "0",
                  "--save-model", str(tmp_path / "a.pt"), *COMMON, name="a")  # fmt: skip
    assert first.summary["steps"] == 0
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    pretrained = folder_tensors(folders["llama"])
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"],
                           pretrained["model.layers.0.mlp.up_proj.weight"])  # fmt: skip
    std = a["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.005, std  # HF's own initializer_range


# ---------------------------------------------------------------------------- bad input


def _broken(folders: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the Llama folder, broken as ``name`` says."""
    folder = tmp_path / name
    shutil.copytree(folders["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    if name == "no-config":
        (folder / "config.json").unlink()
    elif name == "unknown-type":
        config["model_type"] = "no-such-architecture"
    elif name == "remote-code":
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    elif name == "wrong-shapes":
        config["intermediate_size"] = 48
    elif name == "renamed-keys":  # keys that only a conversion would map (fused experts)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        file = index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
        tensors = safetensors_torch.load_file(folder / file)
        renamed = {k.replace("mlp.up_proj", "mlp.experts.0.w3"): v for k, v in tensors.items()}
        safetensors_torch.save_file(renamed, folder / file, metadata={"format": "pt"})
        index["weight_map"] = {
            k.replace("mlp.up_proj", "mlp.experts.0.w3"): v for k, v in index["weight_map"].items()
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if (folder / "config.json").exists():
        (folder / "config.json").write_text(json.dumps(config))
    return folder


BAD = [
    ("no-config", r"has no config.json \(expected a folder as save_pretrained writes it\)"),
    ("unknown-type", r"model type 'no-such-architecture' is not known to transformers"),
    ("remote-code", r"needs remote code \(auto_map in config.json\)"),
    ("wrong-shapes", r"tensor model.layers.0.mlp.\w+.weight has shape \[\d+, \d+\] in "
                     r"model-\d+-of-\d+.safetensors, but the config gives \[\d+, \d+\]"),
    ("renamed-keys", r"do not map one to one onto the modules of LlamaForCausalLM \(e.g. "
                     r"model.layers.0.mlp.experts.0.w3.weight\); an architecture that needs "
                     r"transformers' key conversion is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_folder_is_one_line_and_exit_2(folders, tmp_path, capsys, name, message):
    folder = _broken(folders, tmp_path, name)
    with pytest.raises(UsageError, match=message):
        resolve(TrainConfig(model=f"hf:{folder}", seq_len=SEQ), 2)
    assert cli.main(["train", "--model", f"hf:{folder}", *COMMON]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp2lab: error: --model hf:"), err


def test_seq_len_above_max_position_embeddings_is_refused(folders):
    with pytest.raises(UsageError, match=r"^--seq-len 129 is above the model's "
                                         r"max_position_embeddings 128$"):  # fmt: skip
        resolve(TrainConfig(model=f"hf:{folders['llama']}", seq_len=129), 1)


def test_a_missing_folder_and_an_uncached_hub_id_are_refused_before_any_worker(tmp_path):
    proc = run_cli(["train", "--model", "hf:no-org/no-such-model", "--nproc-per-node", "2"],
                   cwd=tmp_path, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        "fsdp2lab: error: --model hf:no-org/no-such-model: no such folder, nor a hub model in "
        "the local Hugging Face cache (download it first: `hf download ID` on a machine with "
        "internet)\n"
    )


def test_a_hub_id_in_the_local_cache_is_found_offline(folders, tmp_path, monkeypatch):
    """The cache layout ``hf download`` writes: models--ORG--NAME/snapshots/REV + refs/main."""
    repo = tmp_path / "hub" / "models--some-org--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(folders["llama"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    plan = resolve(TrainConfig(model="hf:some-org/tiny-llama", seq_len=SEQ), 1)
    assert plan.spec.source == str(snapshot)
    assert plan.spec.load_weights is not None


# ---------------------------------------------------------------------------- round trip


def test_fine_tune_on_tokens_then_export_loads_in_from_pretrained_with_tokenizer(folders, tmp_path):
    """prepare -> train (FSDP2, 2 ranks) -> ckpt export: from_pretrained gives the trained
    logits, and the folder holds the source's tokenizer files and generation config."""
    from test_hf_tokens import documents, make_tokenizer

    source = tmp_path / "llama"
    shutil.copytree(folders["llama"], source)
    make_tokenizer(source)  # vocabulary 300: the model's
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(300, seed=2)))
    prepare = ["data", "prepare", "--tokenizer", str(source), "--input", str(corpus),
               "--out", str(tmp_path / "tokens"), "--progress", "off"]  # fmt: skip
    assert cli.main(prepare) == 0
    run = train(tmp_path, "--model", f"hf:{source}", "--dataset", f"tokens:{tmp_path / 'tokens'}",
                "--tokenizer", str(source), "--nproc-per-node", "2", "--max-steps", "6",
                "--global-batch-size", "8", "--optimizer", "adam", "--lr", "1e-3",
                "--ckpt-dir", str(tmp_path / "ckpt"), "--save-model", str(tmp_path / "final.pt"),
                *COMMON)  # fmt: skip
    assert run.summary["steps"] == 6
    out = tmp_path / "exported"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<eos>"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(v, final[k]) for k, v in loaded.state_dict().items())
    before = folder_tensors(source)
    assert not torch.equal(final["model.norm.weight"], before["model.norm.weight"])  # trained
    trained = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    trained.load_state_dict(final)
    tokens = torch.tensor([tokenizer.encode("the quick brown fox jumps over a lazy dog")])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, trained.eval()(tokens).logits)
