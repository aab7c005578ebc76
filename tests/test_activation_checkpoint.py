"""Activation checkpointing and per-unit torch.compile: same losses, same parameter names.

Single process and 2 gloo ranks with ``fully_shard`` per unit (the FSDP2 path's order: AC ->
compile -> fully_shard). fp32, exact data; dropout 0 except where dropout's RNG is the point.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fsdp2lab.errors import UsageError
from fsdp2lab.models.gpt import GPT, GPTConfig
from fsdp2lab.parallel import compile as compile_mod
from fsdp2lab.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpointed_units,
    is_checkpointed,
)
from fsdp2lab.parallel.compile import compile_units

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=4, d_model=32, n_heads=4, dropout=0.0)
UNITS = [f"blocks.{i}" for i in range(CFG.n_layers)]
BATCH = 8


def _batches(steps: int, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """The same global batches for every layout; each rank takes its rows. Learnable: counting
    up from a random start, with a random token in every fourth place."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, CFG.vocab_size, (BATCH, 1), generator=g)
        tokens = (start + torch.arange(CFG.seq_len + 1)) % CFG.vocab_size
        noise = torch.randint(0, CFG.vocab_size, tokens.shape, generator=g)
        tokens[:, ::4] = noise[:, ::4]
        out.append(tokens.chunk(world)[rank])
    return out


def _model(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def _train(model, batches, *, world: int = 1) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_checkpointed_units_per_mode():
    assert checkpointed_units(UNITS, "none") == []
    assert checkpointed_units(UNITS, "full") == UNITS
    assert checkpointed_units(UNITS, "selective") == ["blocks.0", "blocks.2"]
    with pytest.raises(UsageError, match="activation-checkpointing"):
        checkpointed_units(UNITS, "sometimes")
    with pytest.raises(UsageError, match="no module 'blocks.9'"):
        apply_activation_checkpointing(_model(), ["blocks.9"], "full")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_losses_and_keys_match_no_ac(mode):
    batches = _batches(20)
    ref_model = _model()
    ref = _train(ref_model, batches)
    model = _model()
    apply_activation_checkpointing(model, UNITS, mode)
    chosen = set(checkpointed_units(UNITS, mode))
    assert {fqn for fqn in UNITS if is_checkpointed(model.get_submodule(fqn))} == chosen
    losses = _train(model, batches)
    assert _max_diff(losses, ref) <= 1e-6, (losses, ref)
    assert losses[-1] < losses[0]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_model.named_parameters()]
    assert list(model.state_dict()) == list(ref_model.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert list(get_model_state_dict(model)) == list(get_model_state_dict(ref_model))
    # A state dict saved with AC loads without it, and the other way round.
    plain = _model()
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(ref_model.state_dict())


def test_ac_recomputes_and_keeps_dropout_rng():
    """With dropout, the recomputed forward draws the same masks: AC changes no loss and no
    gradient, and the unit's forward really runs twice per step."""
    cfg = dataclasses.replace(CFG, dropout=0.2)
    batches = _batches(3)
    ref = _train(_model(cfg), batches)
    model = _model(cfg)
    apply_activation_checkpointing(model, UNITS, "full")
    calls = []
    model.blocks[1].mlp.register_forward_hook(lambda *_: calls.append(1))
    losses = _train(model, batches)
    assert _max_diff(losses, ref) <= 1e-6, (losses, ref)
    assert len(calls) == 2 * len(batches)  # forward + recompute
    # A deep copy recomputes its own forward, not the original's.
    twin = copy.deepcopy(model)
    assert is_checkpointed(twin.blocks[1]) and twin.blocks[1].forward.__self__ is twin.blocks[1]


def test_compile_missing_compiler_is_usage_error(monkeypatch):
    monkeypatch.setattr(compile_mod, "_cpp_compiler", lambda: None)
    with pytest.raises(UsageError, match="C\\+\\+ compiler"):
        compile_units(_model(), UNITS, device_type="cpu")
    with pytest.raises(UsageError, match="no module"):
        compile_units(_model(), ["blocks.9"], backend="eager")


@pytest.mark.slow
def test_compile_with_ac_matches_eager():
    """Inductor on CPU, per unit, on top of selective AC: losses within 1e-4, keys unchanged."""
    batches = _batches(6)
    ref_model = _model()
    ref = _train(ref_model, batches)
    model = _model()
    apply_activation_checkpointing(model, UNITS, "selective")
    compile_units(model, UNITS)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = _train(model, batches)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert _max_diff(losses, ref) <= 1e-4, (losses, ref)
    assert list(model.state_dict()) == list(ref_model.state_dict())


# ---- 2 gloo ranks, fully_shard per unit ---------------------------------------------------


def _fsdp_worker(rank: int, world: int, init_file: str, variants: list[str], out: dict) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        steps = 10 if all("compile" not in v for v in variants) else 5
        for variant in variants:
            model = _model()
            mode, _, compiled = variant.partition("+")
            apply_activation_checkpointing(model, UNITS, mode)
            if compiled:
                compile_units(model, UNITS)
            for fqn in UNITS:
                fully_shard(model.get_submodule(fqn), mesh=mesh)
            fully_shard(model, mesh=mesh)
            losses = _train(model, _batches(steps, rank, world), world=world)
            keys = list(get_model_state_dict(model))
            if rank == 0:
                out[variant] = (losses, keys)
    finally:
        dist.destroy_process_group()


def _run_fsdp(tmp_path, variants: list[str]) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), variants, out), nprocs=2, join=True)
        return dict(out)


def test_fsdp2_with_ac_matches_no_ac_two_ranks(tmp_path):
    out = _run_fsdp(tmp_path, ["none", "full", "selective"])
    ref_losses, ref_keys = out["none"]
    assert ref_losses[-1] < ref_losses[0]
    for mode in ("full", "selective"):
        losses, keys = out[mode]
        assert _max_diff(losses, ref_losses) <= 1e-6, (mode, losses, ref_losses)
        assert keys == ref_keys
    # Sharded over 2 ranks, the losses are those of one process on the whole batch.
    single = _train(_model(), _batches(10))
    assert _max_diff(ref_losses, single) <= 1e-5


@pytest.mark.slow
def test_fsdp2_with_ac_and_compile_two_ranks(tmp_path):
    out = _run_fsdp(tmp_path, ["none", "full+compile"])
    (ref_losses, ref_keys), (losses, keys) = out["none"], out["full+compile"]
    assert _max_diff(losses, ref_losses) <= 1e-4, (losses, ref_losses)
    assert keys == ref_keys
