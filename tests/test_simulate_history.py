"""A simulation's figures do not depend on what the process simulated before it: ``simulate()``
runs the garbage collector first, so tensors held in reference cycles are freed at the same points
of every simulation. The same shallow pipeline copies (an 18-layer Llama, GPipe, full AC,
accumulation: the case where the collector's timing moved a peak) simulated after other
simulations, and after containers allocated to move the collector's counts, give every peak to
the byte, and every part of the step's time, eager and compiled (which follows from the trace's
ops and the storages each reads and writes), as before."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale import layers
from fsdp2lab.scale import simulate as sim
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import get_gpu

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512,
        tie_word_embeddings=False,
    ).save_pretrained(path)  # fmt: skip
    argv = ["train", "--model", f"hf:{path}", "--seq-len", "256", "--mixed-precision", "bf16",
            "--optimizer", "adamw", "--pp", "2", "--batch-size", "4", "--pp-schedule", "gpipe",
            "--pp-microbatches", "2", "--activation-checkpointing", "full",
            "--grad-accum-steps", "2"]  # fmt: skip
    plan = resolve(config_from_args(build_parser().parse_args(argv)), 4, "cuda")
    return [layers.shallow(plan, m) for m in layers.SHALLOW], argv


def _figures(plans, shift: int = 0) -> list[tuple]:
    """Each copy's rank roles' peaks and step times (eager and under ``--compile``), after
    ``shift`` containers allocated (moving the collector's counts)."""
    held = [[] for _ in range(shift)]
    hw = Hardware(get_gpu("h100"), 8, 50.0)
    runs = [(p, sim.simulate(p, rank=r)) for p in plans for r in sim.stage_ranks(p)]
    del held
    compiled = [
        dataclasses.replace(p, cfg=dataclasses.replace(p.cfg, compile=True)) for p, _ in runs
    ]
    return [(run.peak_bytes, estimate(p, run, hw)["time"], estimate(c, run, hw)["time"])
            for (p, run), c in zip(runs, compiled, strict=True)]  # fmt: skip


SHIFTS = (0, 151, 302, 453, 604)


def test_figures_do_not_depend_on_earlier_simulations(plans):
    plans = plans[0]
    first = _figures(plans)
    assert all(_figures(plans, shift) == first for shift in SHIFTS[1:])
    assert _figures(plans[::-1]) == first[2:] + first[:2]  # the deeper copy first
