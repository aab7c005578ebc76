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


def _sharded_norm(grads: list[torch.Tensor], flag: torch.Tensor | None) -> torch.Tensor | None:
    """The norm of gradients on one mesh, from their local shards, where the mesh is 1-D and
    every gradient is sharded over it; None for any other layout. A non-finite ``flag`` on any
    rank makes the norm NaN on every rank (it rides on the same all-reduce)."""
    mesh = grads[0].device_mesh if isinstance(grads[0], DTensor) else None
    if mesh is None or mesh.ndim != 1:
        return None
    if not all(isinstance(g.placements[0], Shard) for g in grads):
        return None
    local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type=2.0)
    device = collective_device(mesh)
    squares = local.float().reshape(1).to(device) ** 2
    if flag is not None:  # + 0 where the flag is finite (the same bits), NaN where it is not
        squares = squares + 0 * flag.float().to(device)
    dist.all_reduce(squares, group=mesh.get_group())
    return squares.sqrt()[0]


def total_grad_norm(
    parameters, pp_group: dist.ProcessGroup | None = None, flag: torch.Tensor | None = None
) -> tuple[torch.Tensor, bool]:
    """The norm of all gradients; with ``pp_group``, over the parameters of every pipeline stage.

    With ``flag`` (a value per rank, e.g. its loss), where the norm's own all-reduce spans every
    rank that holds gradients (one 1-D mesh shards them all: plain FSDP), the flag rides on it: the
    norm is NaN on every rank if the flag is not finite on one. Returns (norm, whether it did)."""
    parameters = list(parameters)
    # Gradients on different meshes (a TP plan that leaves some layers whole: those are sharded
    # over the data-parallel mesh only) are normed per mesh, then combined.
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p.grad)
    squares: torch.Tensor | None = None
    folded = False
    for grads in by_mesh.values():
        part = _sharded_norm(grads, flag if len(by_mesh) == 1 else None)
        folded = part is not None and flag is not None and len(by_mesh) == 1
        if part is None:
            part = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
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
    return norm, folded


def _device(parameters: list[torch.Tensor]) -> torch.device:
    return parameters[0].device if parameters else torch.device("cpu")


def clip_grad_norm_(
    parameters,
    max_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
    flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """The full gradient norm (and whether ``flag`` rode on it: ``total_grad_norm``); scale the
    gradients down to ``max_norm`` if it is given."""
    parameters = list(parameters)
    norm, folded = total_grad_norm(parameters, pp_group, flag)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm, folded
