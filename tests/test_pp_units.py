"""In-process checks of the pipeline pieces, the stage split, the labels and the flag checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp2lab.cli import preflight
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models import MODELS, get_spec, layer_units
from fsdp2lab.models.materialize import build_on_meta
from fsdp2lab.parallel import model_parallel, pp
from fsdp2lab.parallel.strategies import label
from fsdp2lab.runtime.mesh import ParallelDims

SMALL_GPT = dict(n_layers=4, d_model=32, n_heads=4, seq_len=16)


def _input(name: str, cfg: TrainConfig) -> torch.Tensor:
    spec = get_spec(name)
    if spec.task == "lm":
        return torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    return torch.randn(3, *spec.input_shape)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_pieces_run_in_order_are_the_forward(name):
    cfg = TrainConfig(model=name, dropout=0.0, **SMALL_GPT)
    torch.manual_seed(0)
    model = get_spec(name).build(cfg).eval()
    x = _input(name, cfg)
    pieces = pp.pieces_of(name, model)
    # The same pieces in one PiecewiseModule (model-parallel's wrapper, on one device).
    whole = pp.PiecewiseModule(model, pieces).eval()
    assert [n for n, _ in whole.named_parameters()] == [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        torch.testing.assert_close(whole(x), model(x), rtol=0, atol=0)


def test_split_balances_layer_units_and_keeps_names():
    cfg = TrainConfig(model="gpt", **SMALL_GPT)
    model = build_on_meta(lambda: get_spec("gpt").build(cfg))
    units = layer_units(model)
    groups = pp.split("gpt", model, units, 3)
    names = [[n for p in g for n in p.modules] for g in groups]
    # 4 blocks over 3 stages: 1, 1, 2; the embeddings go first, the head last.
    assert names == [
        ["tok_emb", "pos_emb", "drop", "blocks.0"],
        ["blocks.1"],
        ["blocks.2", "blocks.3", "norm", "lm_head"],
    ]
    stage = pp.PiecewiseModule(model, groups[2])
    assert [n for n, _ in stage.named_parameters()][:2] == [
        "blocks.2.attn_norm.weight",
        "blocks.2.attn_norm.bias",
    ]
    with pytest.raises(UsageError, match="--pp 5 is more than the 4 layer units"):
        pp.split("gpt", model, units, 5)


def test_model_parallel_places_groups_on_devices():
    cfg = TrainConfig(model="mlp2")
    model = get_spec("mlp2").build(cfg)

    ctx = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), units=layer_units(model))
    wrapped = model_parallel.apply_model_parallel(model, ctx)
    assert wrapped.devices == [torch.device("cpu")] * 2
    assert [p.modules for p in wrapped.pieces] == [("net1", "relu"), ("net2",)]


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
def test_preflight_rejects(flags, world, message):
    with pytest.raises(UsageError, match=message):
        preflight(TrainConfig(dataset="synthetic", **flags), world)


def test_preflight_accepts_valid_meshes():
    preflight(TrainConfig(model="gpt", dataset="synthetic", tp=2, pp=2, **SMALL_GPT), 8)
    preflight(TrainConfig(model="cnn", dataset="synthetic", pp=4, pp_schedule="gpipe"), 4)
    preflight(TrainConfig(model="mlp2", dataset="synthetic", strategy="model-parallel"), 1)
