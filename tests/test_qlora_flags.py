"""``--quantize-base nf4``'s checks that need neither torchao nor PEFT, each one line: it needs
``--lora-rank``; without torchao, or with one too old to have NF4Tensor, the plan refuses."""

from __future__ import annotations

import sys
import types

import pytest

from fsdp2lab.config import TrainConfig, validate_basic
from fsdp2lab.errors import UsageError
from fsdp2lab.plan import resolve

QLORA = {"model": "gpt", "dataset": "synthetic", "lora_rank": 4, "quantize_base": "nf4"}


def test_needs_lora_rank():
    with pytest.raises(UsageError, match=r"^--quantize-base nf4 needs --lora-rank R$"):
        validate_basic(TrainConfig(model="gpt", quantize_base="nf4"))
    with pytest.raises(UsageError, match="--quantize-base must be one of nf4, not 'int8'"):
        validate_basic(TrainConfig(model="gpt", lora_rank=4, quantize_base="int8"))


def hide_torchao(monkeypatch, torchao=None) -> None:
    """Make ``import torchao`` give ``torchao`` (None: ImportError), and its NF4 modules fail."""
    for name in list(sys.modules):
        if name == "torchao" or name.startswith("torchao."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", torchao)
    for name in ("torchao.quantization", "torchao.dtypes", "torchao.dtypes.nf4tensor"):
        monkeypatch.setitem(sys.modules, name, None)


def test_without_torchao_the_plan_refuses(monkeypatch):
    hide_torchao(monkeypatch)
    with pytest.raises(
        UsageError, match=r"^--quantize-base needs torchao, which is not installed \(pip install "
    ):
        resolve(TrainConfig(**QLORA), 2, "cpu")


def test_with_a_torchao_without_nf4_the_plan_refuses(monkeypatch):
    hide_torchao(monkeypatch, types.SimpleNamespace(__version__="0.1.0"))
    with pytest.raises(UsageError, match=r"^--quantize-base: torchao 0\.1\.0 has no NF4Tensor"):
        resolve(TrainConfig(**QLORA), 2, "cpu")
