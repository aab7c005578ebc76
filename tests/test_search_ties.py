"""``fsdp2lab plan --search`` knows its error: layouts whose planned tokens/s are within the time
model's largest error on the runs it is checked against (``scale.checked_rows``) are a tie,
ranked simplest first, and the output marks them."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp2lab.scale.checked_rows import MODEL_ERROR
from fsdp2lab.scale.search import Layout, format_search, rank_with_ties

FSDP4_TP2_NO_AC = Layout(tp=2, pp=1, r=1, k=4, ac="none", units="layer", reshard="false")
FSDP8_OP_AC = Layout(tp=1, pp=1, r=1, k=2, ac="op", units="layer", reshard="false")
FSDP8_FULL_AC = Layout(tp=1, pp=1, r=1, k=1, ac="full", units="layer", reshard="false")
HSDP2_OP_AC = Layout(tp=1, pp=1, r=2, k=2, ac="op", units="layer", reshard="false")


def _figures(rate: float, mesh: dict) -> dict:
    return {"tokens_per_s_per_gpu": rate, "mesh": mesh}


# Llama 3.1 8B, global batch 16 x 8192 on 8 H100 (docs/scale.md's `--search` of the hf: Llama):
# FSDP 4 x TP 2 without AC planned 2% ahead of torchtitan's FSDP 8 with per-op AC at a
# micro-batch of 1 (7,722 and 7,565), and FSDP 8 with full AC (6,874, the fixture's search); an
# HSDP layout between them (its figure made up) for the rule's mesh dimensions.
LLAMA3_8B_ON_8_H100 = [
    (FSDP4_TP2_NO_AC, _figures(7722, {"dp_shard": 4, "tp": 2})),
    (HSDP2_OP_AC, _figures(7700, {"dp_replicate": 2, "dp_shard": 4})),
    (FSDP8_OP_AC, _figures(7565, {"dp_shard": 8})),
    (FSDP8_FULL_AC, _figures(6874, {"dp_shard": 8})),
]


def test_llama3_8b_on_8_h100_ranks_fsdp8_with_op_ac_first():
    """Within the model's error all four tie: one mesh dimension before two, no TP before TP,
    per-op AC before full."""
    ranked = rank_with_ties(LLAMA3_8B_ON_8_H100, MODEL_ERROR)
    assert [(x, tie) for x, _, tie in ranked] == [
        (FSDP8_OP_AC, 1),
        (FSDP8_FULL_AC, 1),
        (HSDP2_OP_AC, 1),
        (FSDP4_TP2_NO_AC, 1),
    ]


def test_outside_the_error_no_tie():
    """Apart by more than the error, the faster ranks first, each its own tie."""
    ranked = rank_with_ties(LLAMA3_8B_ON_8_H100[:3], 0.001)
    assert [(x, tie) for x, _, tie in ranked] == [
        (FSDP4_TP2_NO_AC, 1),
        (HSDP2_OP_AC, 2),
        (FSDP8_OP_AC, 3),
    ]


def test_equally_simple_layouts_in_a_tie_keep_the_faster_first():
    slower = (FSDP8_FULL_AC, _figures(8000, {"dp_shard": 8}))
    faster = (dataclasses.replace(FSDP8_FULL_AC, k=2), _figures(8100, {"dp_shard": 8}))
    assert [x for x, *_ in rank_with_ties([faster, slower], MODEL_ERROR)] == [faster[0], slower[0]]


def _entry(layout: Layout, f: dict, tie: int) -> dict:
    time = {"matmul_s": 1.0, "kernels": 10}
    return {"tokens_per_s_per_gpu": f["tokens_per_s_per_gpu"], "mfu": 0.5, "tie": tie,
            "reserved_bytes_per_rank": 2**30, "peak_phase": "training step", "label": "fsdp2",
            "mesh": f["mesh"], "layout": {"ac": layout.ac}, "micro_batch": 1, "time": time,
            "step_s": 1.0, "command": "fsdp2lab train"}  # fmt: skip


@pytest.mark.parametrize("error", [MODEL_ERROR, 0.001])
def test_the_text_marks_ties(error):
    ranked = rank_with_ties(LLAMA3_8B_ON_8_H100, error)
    r = {"model": "m", "world_size": 8, "gpu": "h100", "global_batch": 16, "seq_len": 8192,
         "layouts": 4, "simulated": 4, "extended": 0, "derived": 0, "pruned_by_memory": 0,
         "pruned_by_speed": 0, "fit": 4, "fixed": {}, "model_error": error,
         "top": [_entry(*t) for t in ranked]}  # fmt: skip
    listed = [
        line for line in format_search(r).splitlines() if line[:2] in ("1.", "2.", "3.", "4.")
    ]
    tied = [line.split(" ", 1)[1].startswith("(tie 1) ") for line in listed]
    assert tied == [error == MODEL_ERROR] * 4
    assert ("are a tie" in format_search(r)) == (error == MODEL_ERROR)
