"""A small decoder-only transformer language model (GPT-2 style, pre-norm), sized by flags.

Attention and MLP use separate q/k/v/o and up/down projections so that tensor parallelism can split
them by heads and columns; the number of heads is read from the projection's output width at run
time, so the same forward works on a TP shard. Sharded per block; a pipeline stage holds a run of
blocks (the first also the embeddings, the last the final norm and head) and skips the rest.

TP plan: attention heads (``wq``/``wk``/``wv`` column-wise, ``wo`` row-wise) and the MLP (``up``
column-wise, ``down`` row-wise) split across ranks; between them the residual stream is split by
sequence position (sequence parallelism: the layer norms run on a slice of the tokens, and the
all-reduces become a reduce-scatter after and an all-gather before each sub-block). The token and
position embeddings are split by rows (vocabulary, positions) and reduce-scatter into sequence
shards; the LM head is column-wise over the vocabulary and all-gathers the full logits. Dropout
only ever acts on split activations (sequence or head shards), so each rank drawing its own masks
is right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:  # tokens in (the first pipeline stage)
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:  # logits out (the last pipeline stage)
            x = self.lm_head(self.norm(x))
        return x

    def init_module(self, fqn: str, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if fqn.endswith(("attn.wo", "mlp.down")):
                std /= math.sqrt(2 * self.cfg.n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        else:
            module.reset_parameters()

    @staticmethod
    def params_for(vocab: int, seq: int, layers: int, d: int) -> int:
        """Parameter count for given sizes (to size a model before building it)."""
        return vocab * d * 2 + seq * d + layers * (12 * d * d + 4 * d) + 2 * d


def build(cfg) -> GPT:
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
            dropout=cfg.dropout_or(0.0),
        )
    )


def tp_plan(model: GPT) -> dict[str, ParallelStyle]:
    sequence_to_full = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        # Logits stay sharded on the vocabulary: the loss is vocabulary-parallel (loss.py).
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for name in model.blocks:
        b = f"blocks.{name}"
        plan |= {
            f"{b}.attn_norm": SequenceParallel(),
            f"{b}.attn": sequence_to_full,
            f"{b}.attn.wq": ColwiseParallel(),
            f"{b}.attn.wk": ColwiseParallel(),
            f"{b}.attn.wv": ColwiseParallel(),
            f"{b}.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"{b}.mlp_norm": SequenceParallel(),
            f"{b}.mlp": sequence_to_full,
            f"{b}.mlp.up": ColwiseParallel(),
            f"{b}.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def blocks(model: GPT) -> list[str]:
    return [f"blocks.{name}" for name in model.blocks]


SPEC = ModelSpec(
    name="gpt",
    build=build,
    task="lm",
    input_shape=None,
    datasets=("synthetic", "text", "tokens"),
    default_dataset="synthetic",
    units=blocks,
    head=lambda m: ["norm", "lm_head"],
    tp_plan=tp_plan,
    tp_sizes=lambda m: {
        "--n-heads": m.cfg.n_heads,
        "--vocab-size": m.cfg.vocab_size,
        "--seq-len": m.cfg.seq_len,
    },
    pipeline=lambda m: ["tok_emb", "pos_emb", "drop", *blocks(m), "norm", "lm_head"],
)
