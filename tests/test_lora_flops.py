"""A LoRA step computes no gradient of a frozen weight (issue: GPU speed, item 4).

torch's ``FlopCounterMode`` counts one real ``Trainer.train_step`` (FSDP2, one CPU rank) of a
tiny Llama, fully fine-tuned and with ``--lora-rank 4``. With T tokens a step and a linear of
``i`` inputs and ``o`` outputs, the full step's matmuls are 6 T i o for every linear (forward,
input gradient, weight gradient). The LoRA step's, derived from the model's shapes alone:

- each frozen linear: its forward 2 T i o, and its input's gradient 2 T i o where that input
  needs one: not for the first layer's q, k and v projections, whose input comes from the frozen
  embedding through a norm (nothing before them trains); never its weight's gradient;
- each adapter (A: i -> r, B: r -> o): forward, weight gradients and B's input gradient, 2 T r (i
  + o) + 2 T r (i + o) + 2 T r o, and A's input gradient 2 T i r where the base's input needs one;
- attention (SDPA) as in the full step.

The counts must equal that exactly; a frozen weight's gradient would add 2 T i o. The matmuls
are ``mm``, ``addmm`` and the fused adapters' in-place ``addmm_`` (which torch's counter leaves
out: counted here as ``addmm``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.training.trainer import Trainer

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

SEQ, BATCH, RANK = 16, 4, 4
MATMULS = ("aten.mm", "aten.addmm", "aten.addmm_")
TOKENS = SEQ * BATCH
FIRST_LAYER_FROM_EMBEDDING = ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                              "layers.0.self_attn.v_proj")  # fmt: skip


def addmm_flops(_, mat1, mat2, *args, **kwargs) -> int:
    """``addmm_``'s FLOPs from its shapes: torch's ``addmm`` formula (the add not counted)."""
    return 2 * mat1[0] * mat1[1] * mat2[1]


def step_flops(runtime, folder, *flags) -> dict[str, int]:
    args = ["train", "--model", f"hf:{folder}", "--dataset", "synthetic", "--seq-len", str(SEQ),
            "--batch-size", str(BATCH), "--optimizer", "adamw", "--progress", "off", *flags]  # fmt: skip
    trainer = Trainer(config_from_args(build_parser().parse_args(args)), runtime)
    batches = iter(trainer.loader)
    trainer.train_step(batches)  # the optimizer state made
    mapping = {torch.ops.aten.addmm_: addmm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        trainer.train_step(batches)
    flops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return {"matmul": sum(flops.pop(op, 0) for op in MATMULS), **flops}


def test_a_lora_step_is_the_full_step_without_frozen_weight_gradients(one_rank, tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    linears = {n.removeprefix("model."): m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}  # fmt: skip
    adapted = {n: m for n, m in linears.items() if n != "lm_head"}
    full = step_flops(one_rank, tmp_path)
    lora = step_flops(one_rank, tmp_path, "--lora-rank", str(RANK), "--lora-dropout", "0")

    def mm(i: int, o: int) -> int:
        return 2 * TOKENS * i * o

    assert full["matmul"] == sum(3 * mm(m.in_features, m.out_features) for m in linears.values())
    expected = 0
    for name, m in linears.items():
        i, o = m.in_features, m.out_features
        input_grad = name not in FIRST_LAYER_FROM_EMBEDDING
        expected += mm(i, o) * (1 + input_grad)  # forward, input gradient; no weight gradient
        if name in adapted:
            expected += 2 * mm(i + o, RANK) + mm(RANK, o) + mm(i, RANK) * input_grad
    assert lora["matmul"] == expected
    # Attention is the same work in both.
    assert {k: v for k, v in lora.items() if k != "matmul"} == {
        k: v for k, v in full.items() if k != "matmul"
    }
    assert lora["matmul"] / full["matmul"] < 0.75  # at this size; about 0.68 at 1.2B
