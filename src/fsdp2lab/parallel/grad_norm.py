"""Gradient norm and clipping that are correct for sharded (DTensor) gradients.

Each rank holds only shards of the gradients, so a local norm would be wrong. The total norm is
computed on the DTensors (a partial norm reduced over the mesh with ``full_tensor``), so it equals the
norm single-process training computes on the full gradients. Where every gradient is sharded over
one 1-D mesh (plain FSDP) the squares of the local shards' norm are summed over the mesh's group
directly, one all-reduce of one element. Pipeline stages hold disjoint parameters, so their
squared norms are summed over the stages' group.

Every tensor a collective reduces sits on that collective's device (``collective_device``): with
``--cpu-offload`` the sharded gradients live on the host while NCCL reduces only GPU tensors, so
their local sums move to the GPU first (one scalar a mesh), as torch's own state-dict gathering
does with offloaded DTensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp2lab.runtime.torch_compat import local_tensor


def collective_device(over: DeviceMesh | dist.ProcessGroup | None) -> torch.device:
    """The device of the tensors a collective over ``over`` reduces: a mesh's device type; for a
    process group, the current GPU where its backend is NCCL, else the CPU (gloo)."""
    if isinstance(over, DeviceMesh):
        kind = over.device_type
    else:
        kind = "cuda" if "nccl" in str(dist.get_backend(over)).lower() else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _onto_mesh_device(norm: torch.Tensor) -> torch.Tensor:
    """A DTensor norm whose local value sits off its mesh's device (offloaded gradients), moved
    there so that reducing it (``full_tensor``) runs on the mesh's collective."""
    if not isinstance(norm, DTensor):
        return norm
    device = collective_device(norm.device_mesh)
    local = norm.to_local()
    if local.device == device:
        return norm
    return DTensor.from_local(local.to(device), norm.device_mesh, norm.placements, run_check=False)


def _sharded_norm(
    grads: list[torch.Tensor], flag: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The norm of gradients on one mesh, from their local shards, where the mesh is 1-D and
    every gradient is sharded over it; None for any other layout. With ``flag`` (a value per
    rank), whether it is non-finite on some rank (1.0) or on none (0.0) rides on the same
    all-reduce, as a second element."""
    mesh = grads[0].device_mesh if isinstance(grads[0], DTensor) else None
    if mesh is None or mesh.ndim != 1:
        return None
    if not all(isinstance(g.placements[0], Shard) for g in grads):
        return None
    local = torch.nn.utils.get_total_norm([local_tensor(g) for g in grads], norm_type=2.0)
    device = collective_device(mesh)
    values = local.float().reshape(1).to(device) ** 2
    if flag is not None:
        bad = (~torch.isfinite(flag.detach())).float().reshape(1).to(device)
        values = torch.cat([values, bad])
    dist.all_reduce(values, group=mesh.get_group())
    return values[0].sqrt(), (values[1].clamp(max=1.0) if flag is not None else None)


def total_grad_norm(
    parameters, pp_group: dist.ProcessGroup | None = None, flag: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The norm of all gradients; with ``pp_group``, over the parameters of every pipeline stage.

    With ``flag`` (a value per rank, e.g. its loss), where the norm's own all-reduce spans every
    rank that holds gradients (one 1-D mesh shards them all: plain FSDP), whether the flag is
    non-finite on some rank rides on it. Returns (norm, that verdict as a 0-dim 1.0/0.0 tensor on
    the norm's device, or None where it could not ride)."""
    parameters = list(parameters)
    # Gradients on different meshes (a TP plan that leaves some layers whole: those are sharded
    # over the data-parallel mesh only) are normed per mesh, then combined.
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p.grad)
    squares: torch.Tensor | None = None
    verdict = None
    for grads in by_mesh.values():
        sharded = _sharded_norm(grads, flag if len(by_mesh) == 1 else None)
        if sharded is None:
            part = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        else:
            part, verdict = sharded
        if isinstance(part, DTensor):
            part = _onto_mesh_device(part).full_tensor()
        squared = part.float() ** 2
        squares = squared if squares is None else squares + squared.to(squares.device)
    if squares is None:  # no gradients here
        device = collective_device(pp_group) if pp_group is not None else _device(parameters)
        squares = torch.zeros((), device=device)
    norm = squares.sqrt() if len(by_mesh) > 1 else (part if by_mesh else squares)
    if pp_group is not None:
        # Each stage holds different parameters: the total is the root of the summed squares.
        squared = norm.float().to(collective_device(pp_group)) ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    return norm, verdict


def _device(parameters: list[torch.Tensor]) -> torch.device:
    return parameters[0].device if parameters else torch.device("cpu")


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by to clip their norm ``norm`` to ``max_norm``: the inverse of
    the factor ``torch.nn.utils.clip_grads_with_norm_`` multiplies by, ``max(1, (norm + 1e-6) /
    max_norm)``, on the device (no host read)."""
    return ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)


def clip_grad_norm_(
    parameters,
    max_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
    flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full gradient norm (and the verdict on ``flag`` where it rode on the norm's all-reduce:
    ``total_grad_norm``); scale the gradients down to ``max_norm`` if it is given."""
    parameters = list(parameters)
    norm, verdict = total_grad_norm(parameters, pp_group, flag)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm, verdict
