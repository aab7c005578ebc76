"""What a model says about itself: how to build it, what it eats, and how it may be parallelised.

Every plan is written in module names (FQNs), never as code that re-runs the model:

* ``units``: the modules sharded one ``fully_shard`` each (transformer blocks, conv/linear layers);
  also the units of activation checkpointing and ``torch.compile``.
* ``head``: the output head's modules (final norm, vocabulary projection), sharded as one unit of
  their own after the layers where they are large (their gradient is reduce-scattered and freed
  before the layers' backward, instead of being held to the end of the step by the root).
* ``tp_plan``: ``{module name: ParallelStyle}`` for ``parallelize_module``; ``tp_sizes`` the sizes
  ``--tp`` must divide.
* ``pipeline``: the modules in forward order. A pipeline stage is the model with the modules of
  the other stages removed (``None``, or deleted from their container), so the model's forward must
  skip a module that is ``None``, and iterate its containers (``for block in self.blocks``).
  A model whose forward does not (a Hugging Face model) gives ``pipeline_stage``: called on a stage
  after the other stages' modules were removed, it makes the stage run as one (its input the
  previous stage's output, its output the next stage's input; the last stage's the model's).

A model that gives no ``units`` gets them inferred (:func:`infer_units`); one without a TP plan or a
pipeline cannot use ``--tp`` or ``--pp``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn


def infer_units(model: nn.Module, class_name: str | None = None) -> list[str]:
    """The repeated blocks: of the classes that occur more than once as children of a
    ``ModuleList``/``Sequential``/``ModuleDict``, the one whose instances hold the most parameters
    (a transformer block, not the linear layers inside it); or every module of ``class_name``.
    Outermost first; none found: no units (the root is the only one)."""
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    candidates: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if class_name is not None:
            if type(module).__name__ == class_name and name:
                candidates.append((name, module))
        elif isinstance(module, containers):
            prefix = f"{name}." if name else ""
            candidates += [
                (prefix + child_name, child)
                for child_name, child in module.named_children()
                if any(True for _ in child.parameters())
            ]
    if class_name is None:
        counts = Counter(type(m) for _, m in candidates)
        repeated = [cls for cls, n in counts.items() if n > 1]
        if not repeated:
            return []
        best = max(repeated, key=lambda cls: (_params(candidates, cls), counts[cls]))
        candidates = [(n, m) for n, m in candidates if type(m) is best]
    outermost: list[str] = []
    for name, _ in candidates:  # named_modules is pre-order: a parent comes before its children
        if not any(name.startswith(f"{outer}.") for outer in outermost):
            outermost.append(name)
    return outermost


def _params(candidates: list[tuple[str, nn.Module]], cls: type) -> int:
    return sum(p.numel() for _, m in candidates if type(m) is cls for p in m.parameters())


def no_sizes(model: nn.Module) -> dict[str, int]:
    return {}


def no_head(model: nn.Module) -> list[str]:
    return []


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[Any], nn.Module]  # TrainConfig -> model (called under torch.device("meta"))
    task: str  # "classify" (input -> class) | "lm" (tokens -> next token)
    input_shape: tuple[int, ...] | None  # one sample's shape (classifiers)
    datasets: tuple[str, ...]  # datasets whose samples fit the model
    default_dataset: str  # what --dataset auto tries first
    units: Callable[[nn.Module], list[str]] = infer_units
    head: Callable[[nn.Module], list[str]] = no_head
    tp_plan: Callable[[nn.Module], dict[str, Any]] | None = None
    tp_plan_name: str | None = None  # which plan it is, for the log (where a model has several)
    tp_sizes: Callable[[nn.Module], dict[str, int]] = no_sizes
    pipeline: Callable[[nn.Module], list[str]] | None = None
    # (a pipeline stage: the model with the other stages' modules removed) -> None: makes it run
    # as one stage, in place, parameter names unchanged. None: the model's forward already does.
    pipeline_stage: Callable[[nn.Module], None] | None = None
    num_classes: int | None = None  # classifiers: output width
    loss: Callable[[Any, Any], Any] | None = None  # (output, target) -> mean; None: cross-entropy
    # Build with parameters on meta but buffers real (models whose buffers no init can rebuild).
    real_buffers: bool = False
    # Per dataset, the training config values measured best for it (``--recipe tuned``): they fill
    # the flags the user leaves unset (TrainConfig.with_recipe).
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Config values the model fixes (a pretrained model's vocab_size): they replace the flags'.
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # (model parallelised and materialised, unparallelised meta model) -> weights read into the
    # model instead of the seeded init (a pretrained model's files); None: the seeded init.
    load_weights: Callable[[nn.Module, nn.Module], None] | None = None
    source: str | None = None  # the folder a pretrained model was read from


def logits_of(output: Any) -> torch.Tensor:
    """A model's output as logits: a tensor, or the ``logits`` of a Hugging Face style output."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned {type(output).__name__}: expected a tensor of logits, or an "
            "output with .logits"
        )
    return logits
