"""Memory across TP degrees, planned and real: at ``--tp k`` (sequence parallelism, the loss
vocabulary-parallel) a rank's activations and the rest of its peak are 1/k of TP 1's, but for
what stays whole on every tp rank (``W``): the sequence all-gathered into each attention, MLP and
the head (saved for their weights' gradients: ``2 x layers + 1`` tensors of batch x seq x
d_model), and for the ``hf:`` Llama also the rotary embedding's cos and sin (seq x head_dim
each, shared by the layers).

For the ``gpt`` (slow) and a tiny ``hf:`` Llama (hf: its config saved by ``save_pretrained``,
our sequence-parallel plan, ``hf.sequence_parallel_plan``), at a step's peak: on the real trainer
(4 gloo CPU ranks, TP 1, 2 and 4 in one launch of ``tests/scripts/tp_memory.py``) as the CPU
allocator's own events (torch's profiler) show it, and in ``fsdp2lab plan``'s simulation of the
same runs (torch's ``FSDPMemTracker``), which agree within 1% (each category but for one loss
chunk, filed by the two under different phases). The loss's chunk is scaled to
the tiny models (64 tokens of 8,192 logits), as a 128,256-token vocabulary's is 523 tokens of a
step's thousands.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.simulate import simulate
from fsdp2lab.training import loss

ROOT = Path(__file__).resolve().parents[1]
TP_MEMORY = ROOT / "tests" / "scripts" / "tp_memory.py"
LAYERS, D, HEADS, SEQ, BATCH, VOCAB = 2, 128, 4, 128, 4, 8192
RUN = ["--seq-len", str(SEQ), "--batch-size", str(BATCH), "--synthetic-size", "512",
       "--progress", "off"]  # fmt: skip
GPT = ["--model", "gpt", "--n-layers", str(LAYERS), "--d-model", str(D), "--n-heads", str(HEADS),
       "--vocab-size", str(VOCAB)]  # fmt: skip
CHUNK_BYTES = 64 * VOCAB * 4
WORLD = 4
DEGREES = (1, 2, 4)
GATHERED = (2 * LAYERS + 1) * BATCH * SEQ * D * 4  # the gathered inputs, fp32
ROTARY = 2 * SEQ * (D // HEADS) * 4  # the hf: Llama's cos and sin, fp32
CATEGORIES = ("activations", "temporaries")


def save_llama_config(folder: Path) -> Path:
    """A tiny untied Llama's config.json (weights initialised by the trainer, as the plan's)."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def tp(k: int) -> list[str]:
    return ["--tp", str(k)] if k > 1 else []


def real(flags: list[str]) -> dict[int, dict[str, int]]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={WORLD}",
            str(TP_MEMORY),
            "--loss-chunk-bytes",
            str(CHUNK_BYTES),
            "--tp-degrees",
            ",".join(map(str, DEGREES)),
            *flags,
        ],  # fmt: skip
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {int(k): run["by_category"] for k, run in runs.items()}


def planned(flags: list[str], k: int) -> dict[str, int]:
    cfg = config_from_args(build_parser().parse_args(["train", *flags, *tp(k)]))
    return simulate(resolve(cfg, WORLD), device_type="cpu").peak_by_category


@pytest.fixture(
    scope="module",
    params=[pytest.param("gpt", marks=pytest.mark.slow), pytest.param("hf", marks=pytest.mark.hf)],
)
def measured(request, tmp_path_factory):
    if request.param == "gpt":
        flags, whole = [*GPT, *RUN], GATHERED
    else:
        folder = save_llama_config(tmp_path_factory.mktemp("llama"))
        flags, whole = ["--model", f"hf:{folder}", *RUN], GATHERED + ROTARY
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss, "CHUNK_BYTES", CHUNK_BYTES)
        plan = {k: planned(flags, k) for k in DEGREES}
    return {"plan": plan, "real": real(flags), "whole": whole}


@pytest.mark.parametrize("source", ["plan", "real"])
def test_tp_k_holds_a_kth_of_the_activations_and_loss_temporaries(measured, source):
    got, whole = measured[source], measured["whole"]
    sharded = got[1]["activations"] - whole
    assert sharded > 10 * whole, got[1]  # the check is about the sharded part
    for k in DEGREES[1:]:
        expected = whole + sharded / k
        assert abs(got[k]["activations"] / expected - 1) < 0.1, (k, got[k], expected)
        # The loss's chunks come and go in forward (each one's gradient is taken there), so
        # with the activations, as the peak finds them: the rest of the peak is 1/k too.
        peak = [sum(got[j][c] for c in CATEGORIES) for j in (1, k)]
        expected = whole + (peak[0] - whole) / k
        assert abs(peak[1] / expected - 1) < 0.1, (k, got[k], expected)


def test_plan_is_the_real_runs_memory(measured):
    """The plan's peak is the real one within 1%, and so is each category, but for one block of
    a loss chunk's size (``CHUNK_BYTES / k``), which the two file under different phases."""
    for k in DEGREES:
        plan, real = measured["plan"][k], measured["real"][k]
        total = sum(plan[c] for c in CATEGORIES), sum(real[c] for c in CATEGORIES)
        assert abs(total[0] / total[1] - 1) < 0.01, (k, plan, real)
        for category in CATEGORIES:
            off = abs(plan[category] - real[category])
            assert off < 0.01 * real[category] + CHUNK_BYTES / k + 64, (k, category, plan, real)
