"""Model registry: ``--model NAME`` -> a spec that builds the model and says what data it eats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models.cifar_cnn import CifarCNN
from fsdp2lab.models.gpt import GPT, GPTConfig
from fsdp2lab.models.mlp import MLP2, SimpleNN
from fsdp2lab.models.mnist_cnn import Net


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[TrainConfig], nn.Module]
    task: str  # "classify" (image -> class) | "lm" (tokens -> next token)
    input_shape: tuple[int, ...] | None  # image models: C, H, W
    datasets: tuple[str, ...]  # datasets whose samples fit the model
    default_dataset: str  # what --dataset auto tries first


def _dropout(cfg: TrainConfig, default: float) -> float:
    return default if cfg.dropout is None else cfg.dropout


def _gpt(cfg: TrainConfig) -> GPT:
    if cfg.d_model % cfg.n_heads:
        raise UsageError(
            f"gpt: --d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}"
        )
    return GPT(
        GPTConfig(
            vocab_size=cfg.vocab_size,
            seq_len=cfg.seq_len,
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            dropout=_dropout(cfg, 0.0),
        )
    )


_IMAGE_28 = ("mnist", "fashion-mnist", "synthetic")
MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(
        "cnn",
        lambda c: Net(_dropout(c, 0.25), _dropout(c, 0.5)),
        "classify",
        (1, 28, 28),
        _IMAGE_28,
        "mnist",
    ),
    "mlp": ModelSpec("mlp", lambda c: SimpleNN(), "classify", (1, 28, 28), _IMAGE_28, "mnist"),
    "mlp2": ModelSpec("mlp2", lambda c: MLP2(), "classify", (1, 28, 28), _IMAGE_28, "mnist"),
    "cifar-cnn": ModelSpec(
        "cifar-cnn",
        lambda c: CifarCNN(_dropout(c, 0.25)),
        "classify",
        (3, 32, 32),
        ("cifar10", "synthetic"),
        "cifar10",
    ),
    "gpt": ModelSpec("gpt", _gpt, "lm", None, ("synthetic", "text"), "synthetic"),
}


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name]


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The layer units a model is sharded by (each conv/linear block, each transformer block)."""
    return list(model.layer_units())
