"""The plan's simulation runs the loss's first and last chunk and counts the first's ops again
for those between (``scale.simulate.alike_loss_chunks``): every figure of the rank role against
a simulation that runs every chunk, training step and evaluation, with and without tensor
parallelism (the vocabulary-parallel loss and its all-reduces). The control: counting the
first chunk's ops only once leaves the kernels, bytes and time short, and the comparison sees it."""

from __future__ import annotations

import contextlib

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale import simulate as sim
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import get_gpu
from fsdp2lab.training.loss import chunk_tokens_for

HW = Hardware(get_gpu("h100"), nproc_per_node=8, inter_node_gbs=25.0)
VOCAB = 131072  # 512 tokens a chunk: 2 x 1024 tokens are 4 chunks, 3 x 1000 six, the last short


def _figures(plan) -> tuple:
    run = sim.simulate(plan)
    e = estimate(plan, run, HW)
    return (run.peak_bytes, run.peak_by_category, run.state, run.flops, run.forward_flops,
            {d: dict(k) for d, k in run.comm.items()}, run.phases, len(run.ops),
            sum(op.bytes for op in run.ops), e["time"])  # fmt: skip


def _every_chunk(monkeypatch):
    monkeypatch.setattr(sim, "alike_loss_chunks", lambda counter: contextlib.nullcontext())


def _plan(argv: list[str], world: int = 2):
    return resolve(config_from_args(build_parser().parse_args(["train", *argv])), world, "cuda")


GPT = ["--model", "gpt", "--n-layers", "2", "--d-model", "64", "--vocab-size", str(VOCAB),
       "--mixed-precision", "bf16", "--optimizer", "adamw"]  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [["--seq-len", "1024", "--batch-size", "2"], ["--seq-len", "1000", "--batch-size", "3"]],
)
def test_first_and_last_chunk_count_as_every_chunk(monkeypatch, flags):
    assert chunk_tokens_for(VOCAB) == 512
    plan = _plan([*GPT, *flags, "--test-batch-size", "3"])
    replayed = _figures(plan)
    _every_chunk(monkeypatch)
    assert replayed == _figures(plan)


def test_the_comparison_sees_chunks_left_uncounted(monkeypatch):
    plan = _plan([*GPT, "--seq-len", "1024", "--batch-size", "2"])
    monkeypatch.setattr(sim.StepCounter, "repeat", lambda self, mark, times: None)
    short = _figures(plan)
    monkeypatch.undo()
    _every_chunk(monkeypatch)
    full = _figures(plan)
    assert short[7] < full[7] and short[8] < full[8]  # ops and bytes
    assert short[9]["step_s"] < full[9]["step_s"]


@pytest.mark.hf
def test_vocabulary_parallel_loss(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2048,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)  # fmt: skip
    plan = _plan(["--model", f"hf:{tmp_path}", "--seq-len", "1024", "--batch-size", "2",
                  "--mixed-precision", "bf16", "--tp", "2"])  # fmt: skip
    replayed = _figures(plan)
    _every_chunk(monkeypatch)
    assert replayed == _figures(plan)
    assert "tp" in replayed[5]
