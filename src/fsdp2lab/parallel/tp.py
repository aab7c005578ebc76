"""Tensor parallelism: each layer's weights split across the ``tp`` ranks (``parallelize_module``).

A column-wise linear (``ColwiseParallel``) holds a slice of the output features and needs the whole
input; a row-wise one (``RowwiseParallel``) holds a slice of the input features and produces partial
sums that are all-reduced (or reduce-scattered). Pairing them, column then row, costs one collective
per pair in forward and one in backward. The plans:

* ``mlp2``: ``net1`` column-wise (hidden units split), ``net2`` row-wise (all-reduce of the logits):
  the Megatron MLP.
* ``mlp``: ``fc.0`` column-wise, ``fc.2`` row-wise with a reduce-scatter that leaves its 64 outputs
  split, ``fc.4`` row-wise again (all-reduce of the logits).
* ``gpt``: attention heads (``wq``/``wk``/``wv`` column-wise, ``wo`` row-wise) and the MLP (``up``
  column-wise, ``down`` row-wise) split across ranks; between them the residual stream is split by
  sequence position (sequence parallelism: the layer norms run on a slice of the tokens, and the
  all-reduces become a reduce-scatter after and an all-gather before each sub-block). The token and
  position embeddings are split by rows (vocabulary, positions) and reduce-scatter into sequence
  shards; the LM head is column-wise over the vocabulary and all-gathers the full logits.

Every parameter becomes a DTensor on the ``tp`` mesh; FSDP2 then shards them over the data-parallel
mesh as well (2D), and DCP checkpoints hold the same full tensors as without TP. Dropout only ever
acts on split activations (sequence or head shards), so each rank drawing its own masks is right.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp2lab.errors import UsageError


def _mlp2_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    return {"net1": ColwiseParallel(), "net2": RowwiseParallel()}


def _mlp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    return {
        "fc.0": ColwiseParallel(),
        "fc.2": RowwiseParallel(output_layouts=Shard(-1)),
        "fc.4": RowwiseParallel(input_layouts=Shard(-1)),
    }


def _gpt_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    sequence_to_full = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    blocks = getattr(model, "blocks", nn.Module())
    for name, _ in blocks.named_children():
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


def _mlp_sizes(model: nn.Module) -> dict[str, int]:
    return {"mlp hidden width fc.0": model.fc[0].out_features, "fc.2": model.fc[2].out_features}


def _mlp2_sizes(model: nn.Module) -> dict[str, int]:
    return {"mlp2 hidden width": model.net1.out_features}


def _gpt_sizes(model: nn.Module) -> dict[str, int]:
    c = model.cfg
    return {"--n-heads": c.n_heads, "--vocab-size": c.vocab_size, "--seq-len": c.seq_len}


# --model NAME -> (the plan for a model or a pipeline stage of it, the sizes T must divide).
PLANS: dict[str, tuple[Callable, Callable]] = {
    "mlp": (_mlp_plan, _mlp_sizes),
    "mlp2": (_mlp2_plan, _mlp2_sizes),
    "gpt": (_gpt_plan, _gpt_sizes),
}


def check(model_name: str, model: nn.Module, tp: int) -> None:
    """UsageError unless ``model`` (the whole, unsplit model) has a TP plan that ``tp`` divides."""
    if tp == 1:
        return
    if model_name not in PLANS:
        raise UsageError(
            f"--tp: model {model_name!r} has no tensor-parallel plan; --tp supports: {', '.join(PLANS)}"
        )
    bad = {k: v for k, v in PLANS[model_name][1](model).items() if v % tp}
    if bad:
        sizes = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise UsageError(
            f"--tp {tp} must divide the sizes tensor parallelism splits; not divisible: {sizes}"
        )


def _has(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def apply_tp(module: nn.Module, model_name: str, tp_mesh: DeviceMesh) -> nn.Module:
    """Parallelise ``module`` (the model, or this rank's pipeline stage of it) over ``tp_mesh``."""
    plan = {k: v for k, v in PLANS[model_name][0](module).items() if _has(module, k)}
    # TP layers return ``DTensor.to_local()`` views; FSDP2 warns in case a caller modifies them in
    # place, which the models never do (the parity tests would see it).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    # Weights are initialised after parallelising (meta device): nothing to scatter yet.
    return parallelize_module(module, tp_mesh, plan, src_data_rank=None)
