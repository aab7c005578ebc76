"""``train --save-hf DIR``: a 2-rank run of a tiny pretrained Llama writes a folder that
``from_pretrained`` loads with the trained model's logits; each rank hands the writer only its
own shards and no rank's Python allocations during the save exceed its shard plus one tensor
(measured by an instrument of the test's own, loaded into every worker as ``sitecustomize``);
bad input is one line and exit code 2 before training."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, train
from fsdp2lab.checkpoint import layout
from fsdp2lab.checkpoint.targets import MARK

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

COMMON = ["--seq-len", "16", "--synthetic-size", "64", "--progress", "off",
          "--global-batch-size", "8", "--optimizer", "adam", "--lr", "1e-3"]  # fmt: skip

# Loaded by every rank (PYTHONPATH): what each safetensors file the writer serialises holds, and
# the peak of Python's allocations (serialised bytes, the joining buffers) during dcp.save.
INSTRUMENT = """
import json, os, tracemalloc
import safetensors.torch
import torch.distributed.checkpoint as dcp

_log = os.path.join(os.environ["SAVE_HF_PROBE"], f"rank{os.environ.get('RANK', '0')}.jsonl")
_save, _dcp_save = safetensors.torch.save, dcp.save


def _write(**record):
    with open(_log, "a") as f:
        f.write(json.dumps(record) + "\\n")


def save(tensors, *args, **kwargs):
    _write(file_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))
    return _save(tensors, *args, **kwargs)


def dcp_save(*args, **kwargs):
    tracemalloc.start()
    try:
        return _dcp_save(*args, **kwargs)
    finally:
        _write(peak=tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


safetensors.torch.save, dcp.save = save, dcp_save
"""


def save_llama(folder: Path) -> Path:
    """A tiny Llama (tied embedding), as save_pretrained writes it, with a generation config."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="200KB")
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_llama(tmp_path_factory.mktemp("hf") / "llama")


def _records(probe: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (probe / f"rank{rank}.jsonl").read_text().splitlines()]


def test_two_ranks_save_a_folder_from_pretrained_loads_with_the_trained_logits(llama, tmp_path):
    probe = tmp_path / "probe"
    (probe / "site").mkdir(parents=True)
    (probe / "site" / "sitecustomize.py").write_text(INSTRUMENT)
    env = {
        "SAVE_HF_PROBE": str(probe),
        "PYTHONPATH": os.pathsep.join([str(probe / "site"), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "out"
    run = train(tmp_path, "--model", f"hf:{llama}", "--nproc-per-node", "2", "--max-steps", "3",
                "--save-hf", str(out), "--save-model", str(tmp_path / "final.pt"), *COMMON,
                env=env)  # fmt: skip
    assert run.summary["steps"] == 3
    assert f"Hugging Face model saved to {out} at step 3" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        ".fsdp2lab-export", "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    assert not list(tmp_path.glob(".out.*"))  # the temporary folder was renamed into place

    # from_pretrained: the trained model's weights and logits.
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    reference.load_state_dict(final)
    before = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    assert not torch.equal(before.model.norm.weight, reference.model.norm.weight)  # trained
    x = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(x).logits, reference.eval()(x).logits
    assert (got - want).abs().max().item() <= 1e-6
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118 (a safe_open handle is not a mapping)
        assert "lm_head.weight" not in names  # stored once
        assert {f.get_tensor(k).dtype for k in names} == {torch.float32}
    assert (out / "generation_config.json").read_bytes() == (
        llama / "generation_config.json"
    ).read_bytes()

    # Memory: each rank hands the writer its own shards (about half the model), and its Python
    # allocations during the save stay within its shard plus one tensor (rank 0 joins them).
    tensors = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    for rank in (0, 1):
        records = _records(probe, rank)
        handed = sum(r.get("file_bytes", 0) for r in records)
        (peak,) = [r["peak"] for r in records if "peak" in r]
        assert 0.4 * total < handed < 0.6 * total, (rank, handed, total)
        assert peak <= handed + largest + 100_000, (rank, peak, handed, largest)
        assert peak < total, (rank, peak, total)


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_runs_save_what_save_model_gathers(tmp_path, flags):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "untied")
    out = tmp_path / "out"
    train(tmp_path, "--model", f"hf:{tmp_path / 'untied'}", "--nproc-per-node", "2", *flags,
          "--max-steps", "2", "--save-hf", str(out), "--save-model", str(tmp_path / "final.pt"),
          *COMMON)  # fmt: skip
    saved, gathered = load_file(out / "model.safetensors"), torch.load(tmp_path / "final.pt")
    assert saved.keys() == gathered.keys()
    assert all(torch.equal(saved[k], gathered[k]) for k in saved)


def test_a_lora_run_saves_the_peft_adapter_folder_ckpt_export_writes(llama, tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    out, ckpt, exported = tmp_path / "adapter", tmp_path / "ckpt", tmp_path / "exported"
    train(tmp_path, "--model", f"hf:{llama}", "--lora-rank", "4", "--lora-alpha", "8",
          "--nproc-per-node", "2", "--max-steps", "3", "--save-hf", str(out),
          "--ckpt-dir", str(ckpt), *COMMON[:-2], "--lr", "1e-2")  # fmt: skip
    from fsdp2lab import cli

    assert cli.main(["ckpt", "export", str(ckpt), str(exported)]) == 0  # PEFT's save_pretrained
    names = ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [".fsdp2lab-export", *names]
    saved, reference = (load_file(f / names[1]) for f in (out, exported))
    assert saved.keys() == reference.keys() and len(saved) == 6 * 7 * 2
    assert all(torch.equal(saved[k], reference[k]) for k in saved)
    config, expected = (json.loads((f / names[0]).read_text()) for f in (out, exported))
    assert set(config.pop("target_modules")) == set(expected.pop("target_modules"))
    assert config == expected
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    x = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(x).logits
        got = peft.PeftModel.from_pretrained(base, out)(x).logits
    assert (got - before).abs().max() > 1e-4  # trained adapters, not the base alone
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, exported)(x).logits
    assert (got - want).abs().max().item() <= 1e-6


def test_a_lora_run_with_merge_saves_the_merged_model_ckpt_export_merge_writes(llama, tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from fsdp2lab import cli

    out, ckpt = tmp_path / "merged", tmp_path / "ckpt"
    run = train(tmp_path, "--model", f"hf:{llama}", "--lora-rank", "4", "--lora-alpha", "8",
                "--nproc-per-node", "2", "--max-steps", "2", "--save-hf", str(out), "--merge",
                "--ckpt-dir", str(ckpt), *COMMON[:-2], "--lr", "1e-2")  # fmt: skip
    assert f"Hugging Face model saved to {out} at step 2" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        ".fsdp2lab-export", "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    exported, adapter = tmp_path / "exported", tmp_path / "adapter"
    assert cli.main(["ckpt", "export", str(ckpt), str(exported), "--merge"]) == 0
    assert cli.main(["ckpt", "export", str(ckpt), str(adapter)]) == 0
    saved, reference = (load_file(f / "model.safetensors") for f in (out, exported))
    assert saved.keys() == reference.keys() and "lm_head.weight" not in saved
    assert all(torch.equal(saved[k], reference[k]) for k in saved)

    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    x = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(x).logits
        want = peft.PeftModel.from_pretrained(base, adapter)(x).logits
        got = merged(x).logits
    assert (want - before).abs().max() > 1e-4  # trained adapters, not the base alone
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "placements", [None, ("S0", "S0", "S0"), ("S0", "R", "S1")], ids=["plain", "rows", "gathered"]
)
def test_merged_state_is_peft_merge_for_every_sharding(one_rank, placements):
    """Plain tensors (DDP, one device), W and B sharded alike on rows (each rank merges its own),
    and shards that do not line up (gathered whole, one weight at a time, sharded again)."""
    peft = pytest.importorskip("peft")
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp2lab.checkpoint.hf_save import merged_state

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(8, 6))
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.inject_adapter_in_model(config, model)
    state = dict(model.state_dict())
    if placements:
        mesh, kinds = (
            init_device_mesh("cpu", (1,)),
            {"S0": Shard(0), "S1": Shard(1), "R": Replicate()},
        )
        names = ["q_proj.base_layer.weight", "q_proj.lora_A.default.weight",
                 "q_proj.lora_B.default.weight"]  # fmt: skip
        for name, kind in zip(names, placements, strict=True):
            state[name] = distribute_tensor(state[name], mesh, [kinds[kind]])
    merged = copy.deepcopy(model)
    merged.q_proj.merge()
    want = merged.q_proj.get_base_layer().weight.detach()
    got = merged_state(model, state)
    assert sorted(got) == ["q_proj.bias", "q_proj.weight"]
    weight = got["q_proj.weight"]
    if placements:
        assert weight.placements == state["q_proj.base_layer.weight"].placements
        weight = weight.full_tensor()
    assert not isinstance(weight, DTensor) and torch.equal(weight, want)
    assert not torch.equal(want, model.q_proj.base_layer.weight)


def every_two_steps(llama: Path, tmp_path: Path, *flags: str):
    """A 2-rank run of 4 steps saving every 2, rank 1's write of the step-2 save 3 s slower
    (``FSDP2LAB_HF_SLOW_AT``); its folder, its saves' steps, the longest time between steps."""
    out = tmp_path / "out"
    run = train(tmp_path, "--model", f"hf:{llama}", "--nproc-per-node", "2", "--max-steps", "4",
                "--save-hf", str(out), "--save-hf-every-steps", "2", "--log-every-steps", "1",
                *flags, *COMMON, env={"FSDP2LAB_HF_SLOW_AT": "1:2"})  # fmt: skip
    saves = [line for line in run.stdout.splitlines() if "Hugging Face model saved" in line]
    times = [r["time"] for r in run.events("step")]
    assert len(times) == 4
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    return out, [s.split(" at step ")[1].split()[0] for s in saves], gap


@pytest.fixture(scope="module")
def sync_run(llama, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sync")
    layout.mark_own(tmp_path / "out", MARK)
    (tmp_path / "out" / "model.safetensors").write_bytes(b"an earlier export")  # replaced
    return every_two_steps(llama, tmp_path)


def test_every_n_steps_replaces_the_folder(sync_run):
    out, steps, gap = sync_run
    assert steps == ["2", "4"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_hidden_layers == 6


def test_async_checkpoint_saves_the_same_folder_while_training_goes_on(llama, sync_run, tmp_path):
    """The sync run's steps wait for the slow write, the async run's go on; the same tensors."""
    from safetensors.torch import load_file

    from fsdp2lab.runtime.faults import SLOW_S

    out, steps, gap = every_two_steps(llama, tmp_path, "--async-checkpoint")
    assert steps == ["2", "4"]
    assert sync_run[2] >= SLOW_S, sync_run  # the measure sees a blocking save
    assert gap < SLOW_S / 2, gap  # training went on during the write
    saved, reference = (load_file(f / "model.safetensors") for f in (out, sync_run[0]))
    assert saved.keys() == reference.keys()
    assert all(torch.equal(saved[k], reference[k]) for k in saved)
    assert not list(tmp_path.glob(".out.*"))  # renamed into place


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "gpt", "--save-hf", "out"],
         "--save-hf writes a Hugging Face folder: model 'gpt' has no Hugging Face config "
         "(use --model hf:PATH, or --save-model)"),
        (["--save-hf-every-steps", "2"], "--save-hf-every-steps needs --save-hf DIR"),
        (["--save-hf", "out", "--merge"], "--merge needs --lora-rank R and --save-hf DIR"),
        (["--save-hf", "out", "--save-hf-every-steps", "0"],
         "--save-hf-every-steps must be >= 1, got 0"),
    ],
    ids=["not-hf", "every-without-dir", "merge-without-lora", "every-0"],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path):
    proc = run_cli(["train", *flags, "--max-steps", "1"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"fsdp2lab: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_a_folder_it_must_not_replace_is_refused_before_training(llama, tmp_path):
    source = tmp_path / "llama"
    shutil.copytree(llama, source)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for out, why in (
        (source, "it is the model folder the run started from"),
        (other, "fsdp2lab did not write that folder (it has no .fsdp2lab-export mark)"),
    ):
        proc = run_cli(["train", "--model", f"hf:{source}", "--nproc-per-node", "2",
                        "--max-steps", "2", "--save-hf", str(out), *COMMON], cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert why in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "Train Epoch" not in proc.stdout
    assert (other / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_a_torch_without_the_sharded_writer_is_refused_by_plan(llama, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp

    from fsdp2lab import cli

    class FullTensorsOnly:
        def __init__(self, path, fqn_to_index_mapping=None): ...

    monkeypatch.setattr(dcp, "HuggingFaceStorageWriter", FullTensorsOnly)
    plan = ["plan", "--world-size", "2", "--model", f"hf:{llama}", "--save-hf", "out", *COMMON]
    assert cli.main(plan) == 2
    assert capsys.readouterr().err == (
        "fsdp2lab: error: --save-hf: this torch's HuggingFaceStorageWriter has no "
        "save_distributed; use --ckpt-dir, then `fsdp2lab ckpt export`\n"
    )
