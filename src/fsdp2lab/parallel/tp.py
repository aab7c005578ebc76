"""Tensor parallelism: each layer's weights split across the ``tp`` ranks (``parallelize_module``).

A column-wise linear (``ColwiseParallel``) holds a slice of the output features and needs the whole
input; a row-wise one (``RowwiseParallel``) holds a slice of the input features and produces partial
sums that are all-reduced (or reduce-scattered). Pairing them, column then row, costs one collective
per pair in forward and one in backward. Each model's plan (``ModelSpec.tp_plan``, by module name)
is in its own file.

Every parameter becomes a DTensor on the ``tp`` mesh; FSDP2 then shards them over the data-parallel
mesh as well (2D), and DCP checkpoints hold the same full tensors as without TP.
"""

from __future__ import annotations

import warnings

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec


def check(spec: ModelSpec, model: nn.Module, tp: int) -> None:
    """UsageError unless the (whole, unsplit) model has a TP plan that ``tp`` divides."""
    if spec.tp_plan is None:
        raise UsageError(
            f"--tp: model {spec.name!r} has no tensor-parallel plan (ModelSpec.tp_plan)"
        )
    spec.tp_plan(model)  # a plan the model cannot take is refused here, before any worker
    bad = {k: v for k, v in spec.tp_sizes(model).items() if v % tp}
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


def apply_tp(module: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh) -> nn.Module:
    """Parallelise ``module`` (the model, or this rank's pipeline stage of it) over ``tp_mesh``."""
    plan = {k: v for k, v in spec.tp_plan(module).items() if _has(module, k)}
    # TP layers return ``DTensor.to_local()`` views; FSDP2 warns in case a caller modifies them in
    # place, which the models never do (the parity tests would see it).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    # Weights are initialised after parallelising (meta device): nothing to scatter yet.
    return parallelize_module(module, tp_mesh, plan, src_data_rank=None)
