"""In-process checks of the pipeline stages, the split, the labels and the plan's flag checks."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models import MODELS, get_spec
from fsdp2lab.models.materialize import build_on_meta
from fsdp2lab.parallel import model_parallel, pp
from fsdp2lab.parallel.strategies import label
from fsdp2lab.plan import resolve
from fsdp2lab.runtime.mesh import ParallelDims

SMALL_GPT = dict(n_layers=4, d_model=32, n_heads=4, seq_len=16)


def _input(name: str, cfg: TrainConfig) -> torch.Tensor:
    spec = get_spec(name)
    if spec.task == "lm":
        return torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    return torch.randn(3, *spec.input_shape)


def _stages(model, groups):
    """Each stage: a copy of ``model`` with the other stages' modules removed (as ``--pp`` does)."""
    stages = []
    for i in range(len(groups)):
        stage = copy.deepcopy(model)
        pp.remove_modules(stage, [n for k, g in enumerate(groups) if k != i for n in g])
        stages.append(stage)
    return stages


@pytest.mark.parametrize("name", sorted(MODELS))
def test_stages_run_in_order_are_the_forward(name):
    cfg = TrainConfig(model=name, dropout=0.0, **SMALL_GPT)
    spec = get_spec(name)
    torch.manual_seed(0)
    model = spec.build(cfg).eval()
    x = _input(name, cfg)
    units = tuple(spec.units(model))
    for n_stages in range(2, len(units) + 1):
        stages = _stages(model, pp.split(spec, model, units, n_stages))
        names = [n for stage in stages for n, _ in stage.named_parameters()]
        assert names == [n for n, _ in model.named_parameters()]  # same FQNs, each once
        y = x
        with torch.no_grad():
            for stage in stages:
                y = stage(y)
            torch.testing.assert_close(y, model(x), rtol=0, atol=0)


def test_split_balances_layer_units_and_keeps_names():
    cfg = TrainConfig(model="gpt", **SMALL_GPT)
    spec = get_spec("gpt")
    model = build_on_meta(lambda: spec.build(cfg))
    units = tuple(spec.units(model))
    groups = pp.split(spec, model, units, 3)
    # 4 blocks over 3 stages: 1, 1, 2; the embeddings go first, the head last.
    assert groups == (
        ("tok_emb", "pos_emb", "drop", "blocks.0"),
        ("blocks.1",),
        ("blocks.2", "blocks.3", "norm", "lm_head"),
    )
    (last,) = _stages(model, groups)[2:]
    assert [n for n, _ in last.named_parameters()][:2] == [
        "blocks.2.attn_norm.weight",
        "blocks.2.attn_norm.bias",
    ]
    assert last.tok_emb is None and list(last.blocks) == ["2", "3"]
    with pytest.raises(UsageError, match="--pp 5 is more than the 4 layer units"):
        pp.split(spec, model, units, 5)


def test_model_parallel_places_groups_on_devices():
    plan = resolve(TrainConfig(model="mlp2", strategy="model-parallel", dropout=0.0), 1)
    assert plan.stages == (("net1", "relu"), ("net2",))
    model = get_spec("mlp2").build(plan.cfg)
    x = torch.randn(3, 1, 28, 28)
    expected = model(x)
    placed = model_parallel.apply_model_parallel(model, plan, None, torch.device("cpu"))
    assert placed is model
    torch.testing.assert_close(placed(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("strategy", "dims", "expected"),
    [
        ("fsdp2", ParallelDims(1, 4), "fsdp2"),
        ("fsdp2", ParallelDims(2, 2), "hsdp"),
        ("fsdp2", ParallelDims(1, 1, tp=2), "tp2"),
        ("fsdp2", ParallelDims(1, 2, tp=2), "fsdp2+tp2"),
        ("fsdp2", ParallelDims(1, 1, pp=2), "pp2"),
        ("fsdp2", ParallelDims(1, 2, pp=2), "pp2+fsdp2"),
        ("fsdp2", ParallelDims(1, 1, tp=2, pp=2), "pp2+tp2"),
        ("model-parallel", ParallelDims(1, 1), "model-parallel"),
    ],
)
def test_labels(strategy, dims, expected):
    assert label(TrainConfig(strategy=strategy), dims) == expected


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (dict(model="gpt", tp=3, n_heads=4), 3, "not divisible: --n-heads 4, --vocab-size 256"),
        (dict(model="mlp2", tp=3), 3, "not divisible: mlp2 hidden width 512"),
        (dict(model="cnn", tp=2), 2, "model 'cnn' has no tensor-parallel plan"),
        (dict(model="mlp2", pp=4), 4, "--pp 4 is more than the 2 layer units of model 'mlp2'"),
        (dict(model="mlp2", pp=2, pp_microbatches=1), 2, "1f1b needs at least as many"),
        (dict(model="mlp2", pp=2, global_batch_size=6), 2, "does not split into"),
        (dict(model="mlp2", pp=2, mixed_precision="fp16"), 2, "use bf16"),
        (dict(model="mlp2", strategy="ddp", tp=2), 2, "use --strategy fsdp2, not ddp"),
        (dict(model="mlp2", strategy="model-parallel"), 2, "runs in one process"),
        (dict(model="mlp2", strategy="model-parallel", pp=2), 1, "one process"),
    ],
)
def test_plan_rejects(flags, world, message):
    with pytest.raises(UsageError, match=message):
        resolve(TrainConfig(dataset="synthetic", **flags), world)


@pytest.mark.parametrize(
    ("flags", "world", "mesh"),
    [
        # what the ranks left over after tp and pp become: data-parallel shards
        (dict(model="gpt", tp=2, pp=2, **SMALL_GPT), 8, (1, 2, 2, 2)),
        (dict(model="cnn", pp=4, pp_schedule="gpipe"), 4, (1, 1, 1, 4)),
        (dict(model="mlp2", strategy="model-parallel"), 1, (1, 1, 1, 1)),
    ],
)
def test_plan_accepts_valid_meshes(flags, world, mesh):
    dims = resolve(TrainConfig(dataset="synthetic", **flags), world).dims
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == mesh
