"""``fsdp2lab plan`` covers the whole run: evaluation, the ``--save-model`` gather and a checkpoint
save (``--async-checkpoint``'s host staging included) besides the training step. ``fits`` means
every phase fits; the report names the phase that sets the peak.

The Llama-3.2-1B-shaped run (hidden 2048, 16 layers, 32 heads, vocabulary 128,256, sequence
2,048, batch 4, bf16, one H200) whose evaluation of 64 test samples in one batch tried to
allocate 62.62 GiB of fp32 logits: the built-in ``gpt`` of that shape here (its logits are the
same size), a ``config.json``-only Llama folder in the ``hf`` stage.
"""

from __future__ import annotations

import json

import pytest

from conftest import GPT_TINY, run_cli
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.estimate import Hardware
from fsdp2lab.scale.gpus import get_gpu
from fsdp2lab.scale.report import format_report, plan_report
from fsdp2lab.scale.simulate import simulate

# 256 synthetic samples: 64 test samples
RUN_1B = ["--seq-len", "2048", "--batch-size", "4", "--mixed-precision", "bf16",
          "--optimizer", "adamw", "--synthetic-size", "256"]  # fmt: skip
GPT_1B = ["--model", "gpt", "--n-layers", "16", "--d-model", "2048", "--n-heads", "32",
          "--vocab-size", "128256", *RUN_1B]  # fmt: skip
FP32_LOGITS_64 = 64 * 2048 * 128256 * 4  # 62.62 GiB
# The loss before it was computed in chunks of tokens: cross-entropy of the whole batch's logits
# upcast to fp32 at once (as --loss, which the plan, like the trainer, then calls).
WHOLE_LOGITS_LOSS = """
import torch.nn.functional as F
from fsdp2lab.models.spec import logits_of

def loss(output, target):
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
"""
SMALL = [*GPT_TINY, "--d-model", "64", "--seq-len", "64", "--batch-size", "4", "--optimizer",
         "adamw"]  # fmt: skip


def report(world: int, flags: list[str], gpu: str = "h200") -> dict:
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    return plan_report(cfg, world, Hardware(get_gpu(gpu), 8, 50.0), alternatives=False)


def plan_of(world: int, flags: list[str]):
    return resolve(config_from_args(build_parser().parse_args(["train", *flags])), world, "cuda")


def test_whole_logits_evaluation_of_64_samples_does_not_fit(tmp_path):
    """The evaluation that ran out of memory plans as not fitting, and sets the peak."""
    loss = tmp_path / "whole_loss.py"
    loss.write_text(WHOLE_LOGITS_LOSS)
    r = report(1, [*GPT_1B, "--test-batch-size", "64", "--loss", f"{loss}:loss"])
    evaluation = r["phases"]["evaluation"]
    assert r["fits"] is False and evaluation["fits"] is False, evaluation
    assert r["peak_phase"] == "evaluation"
    assert evaluation["peak_bytes"] >= FP32_LOGITS_64
    assert r["phases"]["training step"]["fits"] is True
    assert r["roles"][0]["phases"][1]["note"] == "one test batch of 64 x 2048 tokens"


def test_evaluation_takes_the_trainers_chunked_loss():
    """The same 64 samples with the trainer's loss (fp32 logits a chunk of tokens at a time):
    the bf16 logits (31.3 GiB) and no whole fp32 copy; it fits, and sets the peak."""
    r = report(1, [*GPT_1B, "--test-batch-size", "64"])
    evaluation = r["phases"]["evaluation"]
    assert evaluation["fits"] is True and r["fits"] is True
    assert FP32_LOGITS_64 / 2 <= evaluation["peak_bytes"] < FP32_LOGITS_64
    assert r["peak_phase"] == "evaluation"


def test_default_evaluation_batch_fits_and_the_step_sets_the_peak():
    """The default --test-batch-size (a language model's micro-batch) and the trainer's chunked
    loss: every phase fits, the training step sets the peak."""
    r = report(1, GPT_1B)
    assert set(r["phases"]) == {"training step", "evaluation"}
    assert r["fits"] is True and all(p["fits"] for p in r["phases"].values())
    assert r["peak_phase"] == "training step"
    assert r["phases"]["evaluation"]["peak_bytes"] < r["phases"]["training step"]["peak_bytes"]


def test_save_model_and_checkpoint_phases():
    """--save-model gathers each tensor whole on the device (4 shards here) and holds the whole
    model on rank 0's host; --async-checkpoint stages the rank's state (parameter and optimizer
    state shards) on the host; a synchronous save holds one tensor there at a time."""
    plan = plan_of(4, SMALL)
    assert [p.name for p in simulate(plan).phases] == ["training step", "evaluation"]

    run = simulate(plan_of(4, [*SMALL, "--save-model", "m.pt", "--ckpt-dir", "ck",
                               "--async-checkpoint"]))  # fmt: skip
    names = [p.name for p in run.phases]
    assert names == ["training step", "evaluation", "--save-model gather", "checkpoint save"]
    phases = dict(zip(names, run.phases, strict=True))
    full = {k: v.numel() * v.element_size() for k, v in plan.meta_model.state_dict().items()}
    resident = run.state_bytes
    gather = phases["--save-model gather"]
    assert gather.peak_bytes >= resident + max(full.values()), (gather, max(full.values()))
    assert gather.host_bytes == sum(full.values())
    staged = phases["checkpoint save"]
    assert staged.host_bytes == run.state["param_bytes"] + run.state["optimizer_state_bytes"]
    assert staged.peak_bytes >= resident

    sync = simulate(plan_of(4, [*SMALL, "--ckpt-dir", "ck"])).phases[-1]
    assert sync.name == "checkpoint save"
    assert sync.host_bytes == max(full.values()) // 4  # the largest shard


def test_plan_json_and_text_name_the_phases():
    """The --json object lists the phases (per role and the worst role's), names the peak's;
    the text shows them."""
    flags = ["plan", *SMALL, "--world-size", "4", "--save-model", "m.pt", "--ckpt-dir", "ck",
             "--async-checkpoint", "--json"]  # fmt: skip
    proc = run_cli(flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert list(r["phases"]) == ["training step", "evaluation", "--save-model gather",
                                 "checkpoint save"]  # fmt: skip
    role = r["roles"][0]
    assert [p["phase"] for p in role["phases"]] == list(r["phases"])
    assert role["fits"] is all(p["fits"] for p in role["phases"])
    assert role["peak_phase"] == r["peak_phase"]
    assert r["phases"]["checkpoint save"]["host_bytes"] > 0
    text = format_report(r)
    assert "  phases (tracked peak, reserved estimate; host memory):" in text
    assert f"  the run's peak: {r['peak_phase']}; every phase FITS" in text


@pytest.mark.hf
def test_llama_1b_config_alone_evaluation(tmp_path):
    """The run of the report: a Llama-3.2-1B config.json alone (tied embeddings), one H200."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "llama-3.2-1b"
    transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                             max_position_embeddings=131072, rope_theta=500000.0,
                             tie_word_embeddings=True).save_pretrained(folder)  # fmt: skip
    loss = tmp_path / "whole_loss.py"
    loss.write_text(WHOLE_LOGITS_LOSS)
    model = ["--model", f"hf:{folder}", *RUN_1B]
    old = report(1, [*model, "--test-batch-size", "64", "--loss", f"{loss}:loss"])
    assert old["fits"] is False and old["peak_phase"] == "evaluation"
    assert old["phases"]["evaluation"]["peak_bytes"] >= FP32_LOGITS_64
    now = report(1, model)
    assert now["fits"] is True and now["peak_phase"] == "training step"
