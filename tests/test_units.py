"""In-process tests of the pure pieces: config, mesh sizing, batch sizes, sampler, node lists, init."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn as nn

from fsdp2lab.config import TrainConfig, add_train_arguments, config_from_args
from fsdp2lab.data.sampler import DistributedBatchSampler, eval_shards
from fsdp2lab.errors import UsageError
from fsdp2lab.models import MODELS
from fsdp2lab.models.materialize import build_on_meta, init_weights
from fsdp2lab.plan import batch_sizes
from fsdp2lab.runtime.launch_env import detect, expand_nodelist
from fsdp2lab.runtime.mesh import ParallelDims


def parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_toml_then_flags_override(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "gpt"\nepochs = 5\nlr = 1\ndp-replicate = 2\n')
    cfg = parse("--config", str(toml), "--epochs", "7")
    assert (cfg.model, cfg.epochs, cfg.lr, cfg.dp_replicate) == ("gpt", 7, 1.0, 2)
    assert 'model = "gpt"' in cfg.to_toml() and "epochs = 7" in cfg.to_toml()


@pytest.mark.parametrize(
    "content, message",
    [
        ("epochs = [", "is not valid TOML"),
        ("epoch = 3", "unknown key 'epoch'"),
        ('epochs = "three"', "epochs must be int"),
    ],
)
def test_bad_toml_is_a_usage_error(tmp_path, content, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(content)
    with pytest.raises(UsageError, match=message):
        parse("--config", str(toml))


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = parse("--model", "mlp", "--max-grad-norm", "0.5", "--reshard-after-forward", "2")
    toml = tmp_path / "resolved.toml"
    toml.write_text(cfg.to_toml())
    assert parse("--config", str(toml)) == cfg
    assert cfg.reshard_value() == 2


@pytest.mark.parametrize(
    "world, rep, shard, expect",
    [(4, 1, -1, (1, 4)), (4, 2, -1, (2, 2)), (8, 2, 4, (2, 4)), (1, 1, -1, (1, 1))],
)
def test_mesh_sizes(world, rep, shard, expect):
    dims = ParallelDims.resolve(world, rep, shard)
    assert (dims.dp_replicate, dims.dp_shard) == expect


@pytest.mark.parametrize("world, rep, shard", [(4, 3, -1), (4, 2, 4), (2, 1, 3)])
def test_mesh_mismatch_is_a_usage_error(world, rep, shard):
    with pytest.raises(UsageError, match="mesh does not fit"):
        ParallelDims.resolve(world, rep, shard)


def test_hsdp_mesh_names():
    assert [n for n, _ in ParallelDims(2, 2).named_dims()] == ["dp_replicate", "dp_shard"]
    assert [n for n, _ in ParallelDims(1, 4).named_dims()] == ["dp_shard"]


def test_batch_sizes():
    assert batch_sizes(TrainConfig(global_batch_size=128), 4) == (128, 32)
    assert batch_sizes(TrainConfig(batch_size=16, grad_accum_steps=2), 4) == (128, 16)
    assert batch_sizes(TrainConfig(), 2) == (64, 32)
    with pytest.raises(UsageError, match="not divisible"):
        batch_sizes(TrainConfig(global_batch_size=100), 3)
    with pytest.raises(UsageError, match="disagrees"):
        batch_sizes(TrainConfig(global_batch_size=100, batch_size=10), 2)


def test_nodelist_expansion():
    assert expand_nodelist("node[1-2]") == ["node1", "node2"]
    assert expand_nodelist("gpu[08-10,12],login1") == ["gpu08", "gpu09", "gpu10", "gpu12", "login1"]
    assert expand_nodelist("localhost") == ["localhost"]


def test_launch_modes_from_environment():
    torchrun = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1234",
        }
    )
    assert (torchrun.mode, torchrun.rank, torchrun.world_size, torchrun.local_rank) == (
        "torchrun",
        3,
        4,
        1,
    )
    srun = detect(
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "node[3-4]", "SLURM_JOB_ID": "4242"}
    )  # fmt: skip
    assert (srun.mode, srun.rank, srun.world_size, srun.master_addr, srun.master_port) == (
        "slurm",
        2,
        4,
        "node3",
        24242,
    )
    batch_script = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"})
    assert batch_script.mode == "standalone"


def _shares(
    world: int, epoch: int, n: int = 100, global_batch: int = 20, accum: int = 1
) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        sampler = DistributedBatchSampler(n, global_batch, accum, world, rank, seed=3)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_sampler_disjoint_complete_and_reshuffled():
    shares = _shares(world=4, epoch=1)
    flat = [i for rank in shares for batch in rank for i in batch]
    assert sorted(flat) == list(range(100))  # every sample once, shares disjoint
    assert all(len(b) == 5 for rank in shares for b in rank)
    assert _shares(4, 1) == shares  # deterministic
    assert _shares(4, 2) != shares  # reshuffled per epoch


def test_sampler_global_batches_do_not_depend_on_world_size():
    def global_batches(world: int, accum: int = 1) -> list[set[int]]:
        shares = _shares(world, epoch=1, accum=accum)
        per_step = len(shares[0]) // accum
        return [
            {i for rank in shares for b in rank[s * accum : (s + 1) * accum] for i in b}
            for s in range(per_step)
        ]

    assert global_batches(1) == global_batches(2) == global_batches(4) == global_batches(2, accum=2)


def test_sampler_resumes_mid_epoch_at_any_world_size():
    full = _shares(world=1, epoch=2)[0]
    resumed = DistributedBatchSampler(100, 20, 1, 2, 0, seed=3)
    resumed.set_epoch(2, start_sample=40)
    other = DistributedBatchSampler(100, 20, 1, 2, 1, seed=3)
    other.set_epoch(2, start_sample=40)
    assert [a + b for a, b in zip(resumed, other, strict=True)] == full[2:]


def test_eval_shards_cover_test_set_with_equal_batch_counts():
    shards = [eval_shards(1003, 100, 4, r) for r in range(4)]
    assert len({len(s) for s in shards}) == 1
    seen = [i for s in shards for idx, valid in s for i in idx[:valid]]
    assert sorted(seen) == list(range(1003))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_meta_init_is_deterministic_and_matches_eager_shapes(name):
    cfg = TrainConfig(model=name, n_layers=2, d_model=32, seq_len=16)
    spec = MODELS[name]

    def materialised(seed: int) -> dict[str, torch.Tensor]:
        model = build_on_meta(lambda: spec.build(cfg))
        model.to_empty(device="cpu")
        init_weights(model, build_on_meta(lambda: spec.build(cfg)), seed)
        return model.state_dict()

    a, b, c = materialised(1), materialised(1), materialised(2)
    eager = spec.build(cfg).state_dict()
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in eager.items()}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(torch.isfinite(v).all() for v in a.values())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_meta_build_fills_nothing_and_makes_the_same_model(name):
    """``build_on_meta`` skips the initialisers' fills of meta tensors (which hold no values);
    the control, a plain build under ``torch.device("meta")``, runs them. Both make the same
    parameters, shapes, dtypes and tied tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = TrainConfig(model=name, n_layers=2, d_model=32, seq_len=16)
    fills = {"normal_", "uniform_", "fill_", "zero_", "copy_"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def built(meta_build) -> tuple[nn.Module, set[str]]:
        with Ops() as ops:
            return meta_build(), ops.names

    model, ran = built(lambda: build_on_meta(lambda: MODELS[name].build(cfg)))
    with torch.device("meta"):
        plain, ran_plain = built(lambda: MODELS[name].build(cfg))
    assert not ran & fills and ran_plain & fills

    def described(m: nn.Module) -> list[tuple]:
        return [
            (n, p.shape, p.dtype, p.is_meta) for n, p in m.named_parameters(remove_duplicate=False)
        ]

    assert described(model) == described(plain)
    tied = [len({id(p) for p in m.parameters()}) for m in (model, plain)]
    assert tied[0] == tied[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_nan_guard_finds_every_non_finite_value_anywhere(dtype):
    from fsdp2lab.training.nan_guard import _nonfinite

    cpu = torch.device("cpu")
    finite = [torch.randn(7, 5).to(dtype), torch.randn(()).to(dtype), torch.empty(0), None]
    assert _nonfinite([finite], cpu).tolist() == [0.0]
    assert _nonfinite([[], []], cpu).tolist() == [0.0, 0.0]
    for value in (float("nan"), float("inf"), float("-inf")):
        for place in (0, 17, 34):
            bad = torch.randn(35).to(dtype)
            bad[place] = value
            assert _nonfinite([[*finite, bad]], cpu).tolist() == [1.0], (value, place)
            # Each group has its own flag: the bad tensor's, and no other.
            assert _nonfinite([finite, [bad], []], cpu).tolist() == [0.0, 1.0, 0.0]
            assert _nonfinite([[bad], finite], cpu).tolist() == [1.0, 0.0]
        assert _nonfinite([[torch.tensor(value, dtype=dtype)]], cpu).tolist() == [1.0]


def test_the_loss_rides_on_the_gradient_norms_all_reduce_under_plain_fsdp(one_rank, monkeypatch):
    """Plain FSDP: whether the loss is finite rides on the norm's all-reduce as a second element
    (the norm's bits stay those of the plain norm); the NaN guard then decides from the norm and
    that verdict, with no collective of its own, and leaves the verdict on the device."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2lab.parallel.fsdp2 import apply_fsdp
    from fsdp2lab.parallel.grad_norm import total_grad_norm
    from fsdp2lab.training.nan_guard import NanGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    apply_fsdp(model, init_device_mesh("cpu", (1,)), list(model))
    model(torch.randn(3, 4)).sum().backward()
    params = list(model.parameters())
    plain, verdict = total_grad_norm(params)
    assert verdict is None
    for loss in (torch.tensor(2.5), torch.tensor(-0.0)):
        norm, verdict = total_grad_norm(params, flag=loss)
        assert torch.equal(norm, plain) and float(verdict) == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        norm, verdict = total_grad_norm(params, flag=torch.tensor(bad))
        assert torch.equal(norm, plain) and float(verdict) == 1.0

    def no_collective(*args, **kwargs):
        raise AssertionError("the guard ran a collective of its own")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    optimizer = torch.optim.AdamW(params, fused=True)
    trainer = SimpleNamespace(device=torch.device("cpu"), scaler=None, model=model,
                              optimizer=optimizer, last_grad_norm=plain,
                              step_loss_verdict=torch.tensor(0.0),
                              state=SimpleNamespace(step=0))  # fmt: skip
    guard = NanGuard(one_rank, "skip")
    assert float(guard.before_optimizer_step(trainer, torch.tensor(1.0))) == 0.0  # update
    # Another rank's loss was not finite (the verdict says so): the update is dropped.
    trainer.step_loss_verdict = torch.tensor(1.0)
    assert float(guard.before_optimizer_step(trainer, torch.tensor(1.0))) == 1.0
    # A NaN norm is a non-finite gradient.
    trainer.step_loss_verdict, trainer.last_grad_norm = torch.tensor(0.0), torch.tensor(math.nan)
    assert float(guard.before_optimizer_step(trainer, torch.tensor(1.0))) == 1.0


def test_reserved_memory_counts_the_sharded_gradients_once():
    """The allocator model: the gradients' blocks stay reserved (reduce-scatter stream) whether or
    not they are live at the tracked peak; the rest of the peak carries the allocator's factor."""
    from fsdp2lab.scale.estimate import ALLOCATOR_OVERHEAD, reserved_bytes
    from fsdp2lab.scale.simulate import RoleRun

    def run(peak: int, grads_at_peak: int) -> RoleRun:
        state = {"param_bytes": 100, "grad_bytes": 100, "optimizer_state_bytes": 200}
        return RoleRun(0, peak, {"grads": grads_at_peak}, state, flops=0, forward_flops=0)

    factor = 1 + ALLOCATOR_OVERHEAD
    assert reserved_bytes(run(1000, 0)) == int(1000 * factor) + 100  # peak in the loss
    assert reserved_bytes(run(1100, 100)) == int(1000 * factor) + 100  # peak in backward
