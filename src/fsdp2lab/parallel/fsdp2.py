"""FSDP2: ``fully_shard`` each layer unit, then the root, over the data-parallel mesh.

On a 1D mesh (``dp_shard``) this is plain FSDP; on a 2D mesh (``dp_replicate``, ``dp_shard``) it
is HSDP: parameters are sharded within a replica group and replicated across groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fsdp2lab.parallel.precision import DTYPES
from fsdp2lab.runtime.torch_compat import set_custom_reduce_scatter, set_unshard_async_op


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Compute in ``precision``; reduce gradients in fp32; sharded parameters stay fp32."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    units: list[nn.Module],
    *,
    head: list[nn.Module] | None = None,
    precision: str = "fp32",
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    prefetch: int = 0,
    device: torch.device | None = None,
    unit_policy: str = "layer",
    unit_min_params: int | None = None,
    reduce_every_micro_batch: bool = False,
    reduce_by_all_to_all: bool = False,
    unsharded: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard the units (grouped by ``unit_policy``), the ``head`` modules as one more unit where
    they hold ``unit_min_params`` (a large vocabulary's projection: its gradient is then reduced
    and freed before the layers' backward, not held to the end of the step by the root), then the
    root, which takes the parameters no unit holds. The root and the last unit keep their
    parameters gathered from forward to backward, which needs them first.

    ``reduce_by_all_to_all`` (gloo): gradients are reduced by
    :func:`all_to_all_reduce_scatter`. ``unsharded``: frozen parameters FSDP2 leaves alone (its
    ``ignored_params``): not sharded, gathered or cast.

    ``prefetch`` > 0 sets explicit prefetching: each unit's forward all-gathers the next
    ``prefetch`` units, and its backward the previous ones (on CPU, asynchronously, so that they
    overlap compute).
    """
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=mixed_precision_policy(precision),
        offload_policy=offload_policy(cpu_offload, device or torch.device("cpu")),
        ignored_params=unsharded,
    )
    min_params = unit_min_params or default_unit_min_params(dp_mesh.device_type)
    groups = unit_groups(units, unit_policy, min_params)
    if groups and head and sum(_numel(m) for m in head) >= min_params:
        groups.append(head)
    for i, group in enumerate(groups):
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        last = i == len(groups) - 1
        fully_shard(
            group if len(group) > 1 else group[0],
            reshard_after_forward=False if last else reshard_after_forward,
            **kwargs,
        )
    # None: FSDP2's own choice, which reshards no root after forward.
    fully_shard(
        model,
        reshard_after_forward=None if reshard_after_forward is True else reshard_after_forward,
        **kwargs,
    )
    if dp_mesh.device_type == "cpu":
        reduce_with_sum(model)
    if reduce_by_all_to_all:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                set_custom_reduce_scatter(module, all_to_all_reduce_scatter)
    setattr(model, _REDUCE_EVERY, reduce_every_micro_batch)
    if prefetch > 0:
        set_prefetch([g[0] for g in groups], prefetch)
        if dp_mesh.device_type == "cpu":
            # Without CUDA streams an all-gather overlaps compute only if issued asynchronously
            # (gloo runs it on its own thread) and waited for when the unit runs.
            set_unshard_async_op(model, True)
    return model


def reduce_with_sum(model: nn.Module) -> None:
    """Make FSDP2 reduce gradients with ReduceOp.SUM and divide them itself (gloo).

    For fp32/bf16 gradients FSDP2 asks the process group for ReduceOp.AVG, which gloo has got
    silently wrong (pytorch#162338: torch 2.8's gloo reduce-scatter returns the sum; 2.7's too, and
    its all-reduce refuses AVG). With this, the reduce-scatter and HSDP's
    all-reduce get SUM, and FSDP2 divides by the data-parallel size afterwards.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def all_to_all_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp
) -> None:
    """A reduce-scatter of ``input`` into ``output`` by the moves a reduce-scatter makes.

    gloo has no reduce-scatter: torch runs one as an all-reduce of the whole input, which moves
    twice the bytes. Here an all-to-all sends each rank the chunks of ``input`` it reduces, and
    the rank sums them in rank order.
    """
    if op != dist.ReduceOp.SUM:
        dist.reduce_scatter_tensor(output, input, op=op, group=group)
        return
    received = torch.empty_like(input)
    dist.all_to_all_single(received, input, group=group)
    torch.sum(received.view(dist.get_world_size(group), -1), dim=0, out=output)


def default_unit_min_params(device_type: str) -> int:
    """About where a unit's all-gather costs as much in transfer as in fixed overhead.

    Per collective, FSDP2 pays a fixed cost (hooks, copies, launch, and on CPU a synchronous wait
    with no stream to overlap it): milliseconds on gloo, tens of microseconds with NCCL. Units
    below these sizes (``--fsdp-units auto``) cost more in that overhead than they save in
    memory.
    """
    return 1_000_000 if device_type == "cuda" else 4_000_000


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def unit_groups(units: list[nn.Module], policy: str, min_params: int) -> list[list[nn.Module]]:
    """The modules of each ``fully_shard`` call below the root.

    ``layer``: one per layer unit. ``root``: none (the whole model is one unit). ``auto``:
    consecutive units grouped until a group holds ``min_params`` parameters; a smaller remainder
    joins the last group, and a single group is left to the root. Each group costs its
    collectives (an all-gather in forward, another in backward if it reshards, a reduce-scatter),
    and its gathered parameters are the step's transient memory: fewer, larger groups trade
    memory for fewer collectives.
    """
    if policy == "layer":
        return [[u] for u in units]
    if policy == "root":
        return []
    groups: list[list[nn.Module]] = []
    current: list[nn.Module] = []
    size = 0
    for unit in units:
        current.append(unit)
        size += _numel(unit)
        if size >= min_params:
            groups.append(current)
            current, size = [], 0
    if current and groups:
        groups[-1].extend(current)
    # One group would gather everything at once like the root, plus a collective pair for the
    # root's own parameters: leave it all to the root.
    return groups if len(groups) > 1 else []


def set_prefetch(units: list[nn.Module], depth: int) -> None:
    """Explicit prefetch of ``depth`` units ahead in forward and behind in backward."""
    sharded = [u for u in units if isinstance(u, FSDPModule)]
    for i, unit in enumerate(sharded):
        ahead = sharded[i + 1 : i + 1 + depth]
        behind = sharded[max(0, i - depth) : i][::-1]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


_REDUCE_EVERY = "_fsdp2lab_reduce_every_micro_batch"
_GRADIENT_SYNC = "_fsdp2lab_gradient_sync"  # the value last set; FSDP2's own default is on


def reduces_every_micro_batch(choice: str, dp_shard: int) -> bool:
    """``--grad-accum-reduce``: ``auto`` reduce-scatters every micro-batch where that saves
    memory (sharded gradients instead of unsharded ones: more than one shard)."""
    return choice == "every" or (choice == "auto" and dp_shard > 1)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Gradient accumulation: ``enabled`` on the last micro-batch of a step, off before it.

    Reducing every micro-batch (torchtitan's choice), each backward reduce-scatters into the
    sharded gradients, and HSDP all-reduces them across replicas on the last only. Otherwise no
    collective runs before the last micro-batch, and each rank accumulates unsharded gradients.
    FSDP2's setters walk every module: they run only where the value changes (not at all with
    one micro-batch a step).
    """
    if not isinstance(model, FSDPModule) or getattr(model, _GRADIENT_SYNC, True) == enabled:
        return
    if getattr(model, _REDUCE_EVERY, False):  # gradient sync stays on (FSDP2's default)
        model.set_requires_all_reduce(enabled)
    else:
        model.set_requires_gradient_sync(enabled)
    setattr(model, _GRADIENT_SYNC, enabled)


def reshard_all(model: nn.Module) -> None:
    """Free gathered parameters after a forward with no backward (evaluation).

    Units with ``reshard_after_forward=False`` otherwise stay unsharded, holding full parameters.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
