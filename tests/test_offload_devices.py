"""``--cpu-offload`` on CUDA, as far as a CPU can see it: every tensor a collective reduces is put
on that collective's device, whatever device the (offloaded) gradients are on.

- ``collective_device``: a gloo mesh or group reduces CPU tensors, an NCCL one the current GPU.
- The gradient norm moves its local square sums (and the loss flag riding on them) to the
  collective's device before each all-reduce: the data-parallel mesh's, and the pipeline group's.
  Here the collective device is made ``meta`` (the only other device a CPU has) and the
  all-reduce is recorded instead of run: each reduced tensor must be on it.
- The NaN guard reads each device's tensors in its own fused call (a ``_foreach_norm`` over mixed
  devices reads garbage) and returns its flag on the device it is asked for.
- fp16 with ``--cpu-offload`` on CUDA is refused in the plan, in one line (torch's gradient scaler
  checks the host-side gradients over NCCL and updates a CUDA scale from a host flag: it cannot).
The runs on a GPU are in tests/test_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from fsdp2lab import cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.parallel import grad_norm
from fsdp2lab.plan import resolve
from fsdp2lab.training import nan_guard

META = torch.device("meta")


def test_collective_device_is_the_backends(one_rank, monkeypatch):
    mesh = init_device_mesh("cpu", (1,))
    assert grad_norm.collective_device(mesh) == torch.device("cpu")
    assert grad_norm.collective_device(mesh.get_group()) == torch.device("cpu")
    assert grad_norm.collective_device(None) == torch.device("cpu")  # the default group
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert grad_norm.collective_device(mesh.get_group()) == torch.device("cuda", 3)


class _Param:
    def __init__(self, grad: torch.Tensor):
        self.grad = grad


@pytest.fixture
def reduced(one_rank, monkeypatch) -> list[torch.Tensor]:
    """The tensors all-reduced (recorded, not run), with the collective device made ``meta``."""
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(grad_norm, "collective_device", lambda over: META)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t))
    return seen


def test_sharded_norm_and_its_flag_are_reduced_on_the_collective_device(reduced):
    mesh = init_device_mesh("cpu", (1,))
    grads = [distribute_tensor(torch.full((4, 2), 3.0), mesh, [Shard(0)]) for _ in range(2)]
    flag = torch.tensor(float("nan"))  # on the host, like the gradients
    norm, verdict = grad_norm.total_grad_norm([_Param(g) for g in grads], flag=flag)
    assert verdict is not None and verdict.device == META
    assert [t.device for t in reduced] == [META]
    assert norm.device == META


def test_pipeline_sum_is_reduced_on_the_collective_device(reduced):
    grads = [torch.ones(3), torch.ones(2)]  # a stage's plain gradients, on the host
    norm, _ = grad_norm.total_grad_norm([_Param(g) for g in grads], pp_group=dist.group.WORLD)
    assert [t.device for t in reduced] == [META] and norm.device == META


def test_a_partial_norm_moves_onto_its_meshs_device(one_rank, monkeypatch):
    mesh = init_device_mesh("cpu", (1,))
    part = DTensor.from_local(torch.tensor(2.0), mesh, [Partial()])
    assert grad_norm._onto_mesh_device(part) is part  # already there: untouched
    monkeypatch.setattr(grad_norm, "collective_device", lambda over: META)
    moved = grad_norm._onto_mesh_device(part)
    assert moved.to_local().device == META
    assert moved.placements == part.placements and moved.device_mesh is mesh


def test_nan_guard_reads_each_device_in_its_own_call(monkeypatch):
    calls: list[set] = []
    fused = torch._foreach_norm

    def one_device(tensors, ord):
        calls.append({t.device for t in tensors})
        return fused(tensors, ord)

    monkeypatch.setattr(torch, "_foreach_norm", one_device)
    host = [torch.tensor([1.0, float("inf")]), torch.ones(2)]
    flag = nan_guard._nonfinite([[torch.ones((), device=META), *host]], META)
    assert calls == [{META}, {torch.device("cpu")}] and flag.device == META
    calls.clear()
    assert nan_guard._nonfinite([host], torch.device("cpu")).item() == 1.0
    assert nan_guard._nonfinite([host[1:]], torch.device("cpu")).item() == 0.0


FP16_OFFLOAD = "--cpu-offload with --mixed-precision fp16 on CUDA"


def test_fp16_with_cpu_offload_is_refused_on_cuda_only():
    cfg = dataclasses.replace(
        TrainConfig(), model="mlp", dataset="synthetic", cpu_offload=True, mixed_precision="fp16"
    )
    with pytest.raises(UsageError, match=FP16_OFFLOAD):
        resolve(cfg, 1, "cuda")
    assert resolve(cfg, 1, "cpu").cfg.cpu_offload  # gloo: the scaler checks host gradients
    assert resolve(dataclasses.replace(cfg, mixed_precision="bf16"), 1, "cuda")


def test_fp16_with_cpu_offload_on_gpus_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = ["--world-size", "8", "--model", "mlp", "--cpu-offload", "--mixed-precision", "fp16"]
    assert cli.main(["plan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsdp2lab: error: {FP16_OFFLOAD}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
