"""fsdp2lab.runtime.torch_compat: each version-dependent call, with this torch and with the feature
taken away (the fallback runs and says so once).

In-process, on a one-rank gloo group; the pipeline tests run a one-stage pipeline with FSDP2.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

from conftest import cli_env
from fsdp2lab.parallel.fsdp2 import apply_fsdp
from fsdp2lab.runtime import torch_compat
from fsdp2lab.runtime.torch_compat import (
    cuda_memory_history,
    fix_stage_handshake,
    flatten_mesh,
    group_timeout_s,
    notice,
    pipeline_step,
    process_groups,
    set_custom_reduce_scatter,
    set_group_timeout,
    set_unshard_async_op,
)
from skips import other_torch

pytestmark = pytest.mark.compat  # .ci/run runs these again on other torch versions


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo process group and its 1D CPU mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    monkeypatch.setattr(torch_compat, "_noticed", set())


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _sharded(mesh) -> nn.Sequential:
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _lines(out: str, text: str) -> int:
    return sum(text in line for line in out.splitlines())


def test_notice_is_printed_once_and_only_on_rank_0(monkeypatch, capsys):
    notice("k", "something fell back")
    notice("k", "something fell back")
    assert capsys.readouterr().out == "fsdp2lab: something fell back\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    notice("other", "not on rank 1")
    assert capsys.readouterr().out == ""


def test_fsdp2_on_gloo_asks_for_sum_reductions_only(mesh, monkeypatch):
    """FSDP2 would ask gloo for ReduceOp.AVG, which torch 2.8's gloo reduce-scatter sums."""
    calls = []

    def spy(self, enable):
        calls.append((id(self), enable))

    monkeypatch.setattr(FSDPModule, "set_force_sum_reduction_for_comms", spy)
    model = _model()
    apply_fsdp(model, mesh, [model[0], model[2]], unit_policy="layer")
    sharded = {id(m) for m in model.modules() if isinstance(m, FSDPModule)}
    assert len(sharded) == 3
    assert {i for i, _ in calls} == sharded and all(enable for _, enable in calls)


# ---------------------------------------------------------------------- private methods
def test_unshard_async_op_set_where_present_else_one_notice(mesh, monkeypatch, capsys):
    model = _sharded(mesh)
    assert set_unshard_async_op(model, True) is True
    assert capsys.readouterr().out == ""
    monkeypatch.delattr(FSDPModule, "_set_unshard_async_op")
    assert set_unshard_async_op(model, True) is False
    assert set_unshard_async_op(model, True) is False
    assert _lines(capsys.readouterr().out, "_set_unshard_async_op") == 1
    model(torch.randn(3, 4)).sum().backward()  # still runs, synchronously


def test_custom_reduce_scatter_set_where_present_else_one_notice(mesh, monkeypatch, capsys):
    """Where FSDP2 takes a custom reduce-scatter, it calls ours; else gloo's own runs, one notice."""
    calls = []
    model = _sharded(mesh)
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):  # torch 2.8
        assert set_custom_reduce_scatter(model, lambda *args: calls.append(args)) is False
        assert _lines(capsys.readouterr().out, "set_custom_reduce_scatter") == 1
        return
    for module in (model, model[0]):
        assert set_custom_reduce_scatter(module, lambda *args: calls.append(args)) is True
    comm = model[0]._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    out, inp = comm.allocate((2,), dtype=torch.float32, device=torch.device("cpu")), torch.ones(4)
    comm(output_tensor=out, input_tensor=inp, group=None, op=dist.ReduceOp.SUM)
    assert calls == [(out, inp, None, dist.ReduceOp.SUM)] and capsys.readouterr().out == ""
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    assert set_custom_reduce_scatter(model, print) is False
    assert set_custom_reduce_scatter(model, print) is False
    assert _lines(capsys.readouterr().out, "set_custom_reduce_scatter") == 1


def test_flatten_mesh_where_present_else_one_notice(mesh, capsys):
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    flat = flatten_mesh(mesh2d["a", "b"])
    assert flat.mesh_dim_names == ("a_b",) and flat.size() == 1
    assert capsys.readouterr().out == ""
    assert flatten_mesh(object()) is None
    assert flatten_mesh(object()) is None
    assert _lines(capsys.readouterr().out, "no _flatten") == 1


# --------------------------------------------------------------------------- pipelining
def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target) / 2  # a mean, over 2 accumulation steps


def _accumulate(mesh, monkeypatch, hide_native: bool):
    """Two accumulation steps through a one-stage pipeline of 2 micro-batches, under FSDP2;
    returns (sharded grads after the first step, after the second, the reference's)."""
    data = [(torch.randn(4, 4), torch.randn(4, 2)) for _ in range(2)]
    reference = _model()
    for x, y in data:
        _loss(reference(x), y).backward()
    model = _sharded(mesh)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 2, loss_fn=_loss)
    if hide_native:  # a step without finalize_gradients, as before torch 2.15
        step = type(schedule).step
        monkeypatch.setattr(schedule, "step", lambda *a, **kw: step(schedule, *a, **kw))
    after = []
    for i, (x, y) in enumerate(data):
        pipeline_step(schedule, stage, x, target=y, losses=[], finalize=i == 1)
        after.append([p.grad for p in model.parameters()])
    assert not vars(stage).keys() & {"perform_reduce_grad", "backward_one_chunk", "scale_grads"}
    return after[0], after[1], [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("how", ["native", "shadowed"])
def test_pipeline_accumulation_reduces_and_divides_once_at_the_end(mesh, monkeypatch, how):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if how == "native" and not torch_compat._takes(
        PipelineScheduleSingle.step, "finalize_gradients"
    ):
        pytest.skip(other_torch(">=2.15", "this torch's schedules have no finalize_gradients"))
    first, last, expected = _accumulate(mesh, monkeypatch, hide_native=how == "shadowed")
    # Nothing reduced yet: no sharded (DTensor) gradient.
    assert not any(isinstance(g, DTensor) for g in first), first
    for got, want in zip(last, expected, strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)


class _FakeSubmod:
    pass


class _Stage:
    """The stage methods that finish the gradients in torch 2.8-2.9 and 2.10-2.14."""

    def __init__(self):
        self.submod = _FakeSubmod()
        self.calls: list[tuple] = []

    def backward_one_chunk(self, i, loss=None, full_backward=True, last_backward=False):
        self.calls.append(("backward", i, last_backward))

    def scale_grads(self, grad_scale_factor):
        self.calls.append(("scale", grad_scale_factor))


class _StageWithPerform(_Stage):
    def perform_reduce_grad(self, grad_scale_factor):
        self.calls.append(("perform", grad_scale_factor))


class _Schedule:
    """A 2-micro-batch step that finishes the gradients the way ``stage`` does it."""

    def __init__(self, stage):
        self.stage = stage

    def step(self, *args, target=None, losses=None, **kwargs):
        for i in range(2):
            self.stage.backward_one_chunk(i, loss=None, last_backward=i == 1)
        if hasattr(self.stage, "perform_reduce_grad"):
            self.stage.perform_reduce_grad(2)
        else:
            self.stage.scale_grads(2)


@pytest.mark.parametrize("era", ["2.8-2.9", "2.10-2.14"])
def test_pipeline_step_defers_the_finish_with_the_older_stage_methods(monkeypatch, era):
    monkeypatch.setattr(torch_compat, "FSDPModule", _FakeSubmod)
    stage = _StageWithPerform() if era == "2.10-2.14" else _Stage()
    schedule = _Schedule(stage)
    pipeline_step(schedule, stage, finalize=False)
    # 2.10-2.14 reduce in perform_reduce_grad only; 2.8-2.9 in the last backward.
    last = era == "2.10-2.14"
    assert stage.calls == [("backward", 0, False), ("backward", 1, last)]
    assert not vars(stage).keys() & {"perform_reduce_grad", "backward_one_chunk", "scale_grads"}
    stage.calls.clear()
    pipeline_step(schedule, stage, finalize=True)
    finish = ("perform", 2) if era == "2.10-2.14" else ("scale", 2)
    assert stage.calls == [("backward", 0, False), ("backward", 1, True), finish]


def test_pipeline_step_passes_finalize_gradients_where_the_schedule_takes_it():
    seen = {}

    class Schedule:
        def step(self, *args, target=None, losses=None, finalize_gradients=True, **kwargs):
            seen.update(args=args, target=target, finalize_gradients=finalize_gradients)

    pipeline_step(Schedule(), object(), "x", target="y", finalize=False)
    assert seen == {"args": ("x",), "target": "y", "finalize_gradients": False}


def test_pipeline_step_without_fsdp_or_a_known_stage(monkeypatch):
    stage = _Stage()  # its submod is no FSDPModule: the step runs as is
    pipeline_step(_Schedule(stage), stage, finalize=False)
    assert stage.calls[-1] == ("scale", 2)
    monkeypatch.setattr(torch_compat, "FSDPModule", _FakeSubmod)

    class Unknown:
        submod = _FakeSubmod()

        def backward_one_chunk(self, i, loss=None):
            pass

    unknown = Unknown()
    with pytest.raises(RuntimeError, match="--grad-accum-steps 1 with --pp"):
        pipeline_step(_Schedule(unknown), unknown, finalize=False)


class _Handshake:
    """A stage whose first-step handshake sends ``send`` into a float32 tensor (2.9: int64)."""

    def __init__(self, send: torch.dtype):
        self.send = send

    def _get_init_p2p_neighbors_ops(self):
        recv, send = torch.zeros(1), torch.tensor(1, dtype=self.send)
        return [
            dist.P2POp(dist.irecv, recv, group_peer=0),
            dist.P2POp(dist.isend, send, group_peer=0),
        ]


def test_stage_handshake_dtypes_made_to_match_only_where_they_differ(mesh):
    broken = fix_stage_handshake(_Handshake(torch.int64))
    assert "_get_init_p2p_neighbors_ops" in vars(broken)
    assert {op.tensor.dtype for op in broken._get_init_p2p_neighbors_ops()} == {torch.float32}
    right = fix_stage_handshake(_Handshake(torch.float32))
    assert "_get_init_p2p_neighbors_ops" not in vars(right)
    plain = object()
    assert fix_stage_handshake(plain) is plain  # torch 2.8: no handshake


# ---------------------------------------------------------------------- process groups
def test_group_timeout_public_then_private_then_a_notice(mesh, monkeypatch, capsys):
    timeout = timedelta(seconds=77)
    assert set_group_timeout(dist.group.WORLD, timeout) is True
    calls = []
    monkeypatch.delattr(dist, "set_timeout", raising=False)  # before torch 2.14
    monkeypatch.setattr(
        dist.distributed_c10d, "_set_pg_timeout", lambda t, g: calls.append((t, g)), raising=False
    )
    assert set_group_timeout(dist.group.WORLD, timeout) is True
    assert calls == [(timeout, dist.group.WORLD)]
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    assert set_group_timeout(dist.group.WORLD, timeout) is False
    assert set_group_timeout(dist.group.WORLD, timeout) is False
    assert _lines(capsys.readouterr().out, "cannot change a process group's timeout") == 1
    # read back where this torch exposes it (the shared-memory barrier's deadline)
    exposed = hasattr(dist.group.WORLD._get_backend(torch.device("cpu")), "options")
    assert group_timeout_s(dist.group.WORLD) == (77.0 if exposed else None)
    assert group_timeout_s(object()) is None


def test_process_groups_listed_else_the_default_one_with_a_notice(mesh, monkeypatch, capsys):
    assert dist.group.WORLD in process_groups()
    assert capsys.readouterr().out == ""
    world = dist.distributed_c10d._world

    class WithoutPgMap:  # the private registry without the attribute process_groups reads
        def __getattr__(self, name):
            if name == "pg_map":
                raise AttributeError(name)
            return getattr(world, name)

    monkeypatch.setattr(dist.distributed_c10d, "_world", WithoutPgMap())
    assert process_groups() == [dist.group.WORLD]
    assert process_groups() == [dist.group.WORLD]
    assert _lines(capsys.readouterr().out, "does not list its process groups") == 1


def test_memory_snapshot_refused_up_front_without_the_cuda_memory_history(monkeypatch):
    from fsdp2lab.config import TrainConfig
    from fsdp2lab.errors import UsageError
    from fsdp2lab.plan import check_machine, resolve

    assert cuda_memory_history() is not None  # present (private) in every supported torch
    monkeypatch.delattr(torch.cuda.memory, "_dump_snapshot")
    assert cuda_memory_history() is None
    plan = resolve(TrainConfig(model="mlp", memory_snapshot="snap.pickle"), 1, device_type="cuda")
    with pytest.raises(UsageError, match="no torch.cuda.memory._record_memory_history"):
        check_machine(plan)


def test_hf_weights_are_read_by_slices_through_each_reader_this_torch_has(tmp_path):
    """safetensors' get_slice always; DCP's HuggingFaceStorageReader where it reads slices. Two
    FSDP2 ranks (uneven shards of 5 rows), bf16 files into fp32 parameters, a tied head."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder = tmp_path / "weights"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(7, 4, generator=g),
        "proj.weight": torch.randn(5, 4, generator=g),
        "proj.bias": torch.randn(5, generator=g),
        "back.weight": torch.randn(4, 5, generator=g),
    }
    tensors = {k: v.bfloat16() for k, v in tensors.items()}
    safetensors_torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    script = Path(__file__).parent / "scripts" / "hf_load_branches.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script), str(folder), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    branches = ["slices"] + (["dcp"] if torch_compat.hf_storage_reader() is not None else [])
    for branch in branches:
        for rank in (0, 1):
            report = json.loads((tmp_path / f"{branch}.rank{rank}.json").read_text())
            assert set(report) == {"embed.weight", "proj.weight", "proj.bias", "back.weight",
                                   "tied"}, report  # fmt: skip
            assert all(report.values()), (branch, rank, report)


def test_hf_storage_reader_is_used_only_where_it_reads_slices(monkeypatch):
    import torch.distributed.checkpoint as dcp

    real = getattr(dcp, "HuggingFaceStorageReader", None)
    chosen = torch_compat.hf_storage_reader()
    assert chosen is (real if hasattr(real, "_process_read_request") else None)

    class WholeFiles:  # as 2.8's: no per-request slice reads
        pass

    monkeypatch.setattr(dcp, "HuggingFaceStorageReader", WholeFiles, raising=False)
    assert torch_compat.hf_storage_reader() is None


WRITER_LACKS = "this torch's HuggingFaceStorageWriter has no save_distributed"
CONSOLIDATION_LACKS = "this torch cannot consolidate safetensors shards by a tensor-to-file mapping"


def test_hf_sharded_save_says_which_part_this_torch_lacks(monkeypatch):
    import torch.distributed.checkpoint as dcp

    writer = getattr(dcp, "HuggingFaceStorageWriter", None)
    has_writer = writer is not None and "save_distributed" in inspect.signature(writer).parameters
    try:
        from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation
    except ImportError:  # an older torch (2.8): no consolidation module at all
        expected = CONSOLIDATION_LACKS if has_writer else WRITER_LACKS
        assert torch_compat.hf_sharded_save_missing() == expected
        return
    assert has_writer and torch_compat.hf_sharded_save_missing() is None  # this torch has both

    class FullTensorsOnly:  # a writer without per-rank shards
        def __init__(self, path, fqn_to_index_mapping=None): ...

    def by_file_count(input_dir, output_dir, num_threads=1): ...

    monkeypatch.setattr(consolidation, "consolidate_safetensors_files", by_file_count)
    assert torch_compat.hf_sharded_save_missing() == CONSOLIDATION_LACKS
    monkeypatch.setattr(dcp, "HuggingFaceStorageWriter", FullTensorsOnly)
    assert torch_compat.hf_sharded_save_missing() == WRITER_LACKS


def test_pipeline_training_step_keeps_no_outputs_where_the_schedule_allows(mesh):
    """The last stage's logits of each micro-batch go with its backward, not at the step's end."""
    from fsdp2lab.parallel.pp import Pipeline

    pipeline = Pipeline(
        _model(), init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)), torch.device("cpu"),
        n_microbatches=2, schedule="1f1b",
    )  # fmt: skip
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipeline.train_step(x, y, _loss)
    (schedule, stage), *_ = pipeline._schedules.values()
    if not torch_compat._takes(schedule.step, "return_outputs"):
        assert torch_compat.no_step_outputs(schedule) == {}
        pytest.skip(other_torch(">=2.15", "this torch's schedules always return the outputs"))
    assert stage.output_chunks == []
    schedule.step(x, target=y, losses=[])  # the schedule's default keeps them
    assert len(stage.output_chunks) == 2
