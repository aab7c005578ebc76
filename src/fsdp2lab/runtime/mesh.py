"""The DeviceMesh: named dimensions ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` sized from the flags."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2lab.errors import UsageError
from fsdp2lab.runtime.torch_compat import flatten_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def resolve(
        cls, world_size: int, dp_replicate: int, dp_shard: int, tp: int = 1, pp: int = 1
    ) -> ParallelDims:
        """Fill in ``dp_shard = -1`` and check that the degrees multiply to the world size."""
        others = dp_replicate * tp * pp
        if dp_shard == -1:
            if world_size % others:
                raise UsageError(
                    f"mesh does not fit: world size {world_size} is not divisible by "
                    f"dp_replicate={dp_replicate} x tp={tp} x pp={pp} = {others}"
                )
            dp_shard = world_size // others
        if dp_replicate * dp_shard * tp * pp != world_size:
            raise UsageError(
                f"mesh does not fit: dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} x pp={pp} "
                f"= {dp_replicate * dp_shard * tp * pp}, but the world size is {world_size}"
            )
        return cls(dp_replicate, dp_shard, tp, pp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    def named_dims(self) -> list[tuple[str, int]]:
        """Mesh dimensions outer to inner; size-1 dimensions are left out, except dp_shard."""
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("tp", self.tp),
        ]
        return [(n, s) for n, s in dims if s > 1 or n == "dp_shard"]

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.named_dims())


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    named = dims.named_dims()
    mesh = init_device_mesh(
        device_type, tuple(s for _, s in named), mesh_dim_names=tuple(n for n, _ in named)
    )
    # A 2D (FSDP + TP) gradient reduces over dp_shard and tp (norms, inf checks); DTensor does that
    # in one collective, the same on every rank, only where the flattened mesh exists.
    if dims.tp > 1:
        flatten_mesh(mesh["dp_shard", "tp"])
        if dims.dp_replicate > 1:
            flatten_mesh(mesh["dp_replicate", "dp_shard", "tp"])
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard."""
    names = [n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ())]
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def dp_rank(dims: ParallelDims, mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (which share of each batch it takes)."""
    names = mesh.mesh_dim_names or ()
    rep = mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0
    shard = mesh.get_local_rank("dp_shard") if "dp_shard" in names else 0
    return rep * dims.dp_shard + shard
