"""Each eligible LoRA linear runs one fused autograd Function (issue: GPU step, item 4).

:mod:`fsdp2lab.models.lora_fused`: the Function matches PEFT's forward and backward (output, the
input's and both adapters' gradients) within 1e-6 in fp32, at bf16's tolerance under autocast, in
one dtype (FSDP2's mixed precision) and on an NF4 base; a real LoRA step (``Trainer``, one
process, a tiny Llama) dispatches at most 6 ops per adapted linear more than the full fine-tune
(counted with ``tests/scripts/step_ops.py``'s ``TorchDispatchMode``) and no elementwise op over
tokens x features that the full step does not; a layer with dropout, DoRA, merged or disabled
adapters runs PEFT's own forward.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from fsdp2lab.cli import build_parser
from fsdp2lab.config import TrainConfig, config_from_args
from fsdp2lab.training.trainer import Trainer

pytestmark = [pytest.mark.hf]
peft = pytest.importorskip("peft")

from fsdp2lab.models import lora  # noqa: E402  (imports PEFT)
from fsdp2lab.models.lora_fused import FusedLoraLinear, LoraLinearFunction, fuse  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from step_ops import CountOps  # noqa: E402

IN, OUT, RANK, TOKENS = 128, 128, 4, 24  # 128 x 128: whole NF4 blocks
BF16 = 1.6e-2  # torch.testing's bf16 tolerance: two roundings of bf16 (8 bits)


class Block(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=bias)


def adapted(dropout: float = 0.0, bias: bool = True) -> nn.Module:
    """``Block`` with fsdp2lab's adapter on ``proj`` (``apply_lora``), A and B random."""
    torch.manual_seed(0)
    cfg = TrainConfig(model="gpt", lora_rank=RANK, lora_alpha=3.0, lora_dropout=dropout,
                      lora_targets="proj")  # fmt: skip
    model = lora.apply_lora(Block(bias), cfg)
    with torch.no_grad():  # std 1/sqrt(fan-in): outputs and gradients of order 1
        for p in lora.trainable_state(model).values():
            p.normal_(std=p.shape[1] ** -0.5)
    return model


def run(layer: nn.Module, forward, x: torch.Tensor, grad: torch.Tensor, dtype=None):
    """``forward(layer, x)`` and the gradients of x, A and B for the output gradient ``grad``
    (under CPU autocast to ``dtype`` if given)."""
    x = x.detach().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = forward(layer, x)
    out.backward(grad)
    return [out, x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]


def assert_same_as_peft(layer, x, tol: float, dtype=None) -> None:
    """The fused forward (one call of the Function) and PEFT's give the same dtypes, shapes, and
    values within ``tol`` of each tensor's largest (a sum's rounding scales with its terms)."""
    grad = torch.randn(*x.shape[:-1], OUT, dtype=x.dtype if dtype is None else dtype)
    with mock.patch.object(LoraLinearFunction, "apply", wraps=LoraLinearFunction.apply) as spy:
        fused = run(layer, FusedLoraLinear.forward, x, grad, dtype)
    assert spy.call_count == 1
    theirs = run(layer, peft.tuners.lora.Linear.forward, x, grad, dtype)
    for mine, reference in zip(fused, theirs, strict=True):
        assert mine.dtype == reference.dtype and mine.shape == reference.shape
        error = (mine - reference).abs().max() / reference.abs().max()
        assert error <= tol, (error, tol)


@pytest.mark.parametrize("bias", [True, False])
def test_the_function_is_peft_within_1e_6_in_fp32(bias):
    layer = adapted(bias=bias).proj
    assert type(layer) is FusedLoraLinear
    assert_same_as_peft(layer, torch.randn(2, TOKENS // 2, IN), 1e-6)


def test_the_function_is_peft_in_bf16_under_autocast_and_in_one_dtype():
    layer = adapted().proj
    assert_same_as_peft(layer, torch.randn(2, TOKENS // 2, IN), BF16, dtype=torch.bfloat16)
    layer.to(torch.bfloat16)  # FSDP2's mixed precision: base and adapters gathered in bf16
    assert_same_as_peft(layer, torch.randn(TOKENS, IN, dtype=torch.bfloat16), BF16)


def test_an_nf4_base_goes_through_the_function():
    from fsdp2lab.runtime.torch_compat import torchao_nf4

    api = torchao_nf4()
    if isinstance(api, str):
        pytest.skip(api)
    _, to_nf4 = api
    layer = adapted(bias=False).proj
    base = layer.base_layer
    base.weight = nn.Parameter(to_nf4(base.weight.detach(), 64, 256), requires_grad=False)
    assert_same_as_peft(layer, torch.randn(TOKENS, IN), 1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: adapted(dropout=0.1).proj,
        lambda: (
            peft.inject_adapter_in_model(
                peft.LoraConfig(r=RANK, target_modules=["proj"], use_dora=True), Block()
            ).proj
        ),
    ],
    ids=["dropout", "dora"],
)
def test_dropout_and_dora_keep_pefts_forward(make):
    layer = make()
    assert fuse(nn.ModuleDict({"proj": layer})) == []
    assert type(layer) is peft.tuners.lora.Linear


def test_merged_or_disabled_adapters_run_pefts_forward(monkeypatch):
    layer = adapted().proj
    x = torch.randn(TOKENS, IN)
    monkeypatch.setattr(LoraLinearFunction, "apply", None)  # any call to it fails
    layer.merge()
    torch.testing.assert_close(layer(x), peft.tuners.lora.Linear.forward(layer, x))
    layer.unmerge()
    layer.enable_adapters(False)
    torch.testing.assert_close(layer(x), layer.base_layer(x))


# ---------------------------------------------------------------------------- a real step
class CountWide(CountOps):
    """``CountOps``, and the non-matmul ops (views left out) writing at least ``wide``
    elements: passes over tokens x features."""

    MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_}

    def __init__(self, wide: int):
        super().__init__()
        self.wide, self.passes = wide, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        matmul = func._overloadpacket in self.MATMULS
        if not func.is_view and not matmul and any(t.numel() >= self.wide for t in tensors):
            self.passes[func._schema.name] += 1
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_step_adds_at_most_6_ops_per_adapter_and_no_elementwise_pass(
    one_rank, tmp_path, precision
):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    seq, batch = 16, 4
    narrowest = 32  # k_proj and v_proj's outputs: 2 heads of 16

    # Measured: 2.1 ops per adapter in fp32, 4.9 in bf16 (autocast's casts of A and B and of
    # their gradients); PEFT's forward: 20 and 25.
    def step(*flags):
        args = ["train", "--model", f"hf:{folder}", "--dataset", "synthetic", "--seq-len",
                str(seq), "--batch-size", str(batch), "--optimizer", "adamw", "--progress", "off",
                "--strategy", "single", "--mixed-precision", precision, *flags]  # fmt: skip
        trainer = Trainer(config_from_args(build_parser().parse_args(args)), one_rank)
        batches = iter(trainer.loader)
        trainer.train_step(batches)  # the optimizer state made
        counter = CountWide(seq * batch * narrowest)
        with counter:
            trainer.train_step(batches)
        ops = counter.take()
        ops.pop("cost")
        return sum(sum(part.values()) for part in ops.values()), counter.passes, trainer.model

    full_ops, full_passes, _ = step()
    lora_ops, lora_passes, model = step("--lora-rank", str(RANK), "--lora-dropout", "0")
    adapters = len(lora.lora_layers(model))
    assert adapters == 14 and all(type(m) is FusedLoraLinear for _, m in lora.lora_layers(model))
    assert lora_ops - full_ops <= 6 * adapters, (lora_ops, full_ops)
    extra = lora_passes - full_passes
    assert not extra, extra
