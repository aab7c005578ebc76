"""DDP, FSDP1, FSDP2 and HSDP against one process: same loss at every step, same gradient norm,
each rank's share of the state as expected, and DCP checkpoints that move between them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import ShardingStrategy

from conftest import GPT_TINY, TINY, assert_close_lists, cli_env, read_metrics, train
from fsdp2lab import cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.models import get_spec
from fsdp2lab.models.materialize import build_on_meta
from fsdp2lab.parallel import fsdp1
from fsdp2lab.parallel.fsdp2 import default_unit_min_params, unit_groups

STEPS = 25
PARITY = [*TINY, "--synthetic-size", "512", "--global-batch-size", "16"]
PARITY += [
    "--max-steps",
    str(STEPS),
    "--log-every-steps",
    "1",
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
]
MODELS = {
    "mlp": ["--model", "mlp", "--max-grad-norm", "0.5"],  # clipping: each strategy's global norm
    "cnn": ["--model", "cnn"],
    "gpt": [*GPT_TINY, "--grad-accum-steps", "2"],  # no_sync / set_requires_gradient_sync
}
FSDP1, FSDP2 = ["--strategy", "fsdp1"], ["--strategy", "fsdp2"]
DDP = ["--strategy", "ddp"]
HYBRID = [*FSDP1, "--dp-replicate", "2"]  # FSDP1 HYBRID_SHARD
# On 2 ranks: FULL_SHARD, FSDP2 --fsdp-units auto; on 4: HYBRID_SHARD and HSDP (2 x 2).
VARIANTS = {
    2: {"ddp": DDP, "fsdp1": FSDP1, "fsdp2": FSDP2},
    4: {"ddp": DDP, "fsdp1-hybrid": HYBRID, "hsdp": [*FSDP2, "--dp-replicate", "2"]},
}
# Each model also runs some of the other settings.
EXTRA = {
    "mlp": {
        2: {
            "fsdp1-size": [*FSDP1, "--fsdp1-min-params", "1000", "--prefetch", "1"],
            "fsdp2-layer": [*FSDP2, "--fsdp-units", "layer"],  # 3 units, not auto's root alone
        },
        4: {"hsdp-layer": [*FSDP2, "--dp-replicate", "2", "--fsdp-units", "layer"]},
    },
    "cnn": {
        2: {"fsdp1-zero2": [*FSDP1, "--reshard-after-forward", "false"]},  # SHARD_GRAD_OP
        4: {"fsdp1-hybrid-zero2": [*HYBRID, "--reshard-after-forward", "false"]},
    },
    "gpt": {
        2: {
            "fsdp2-layer": [*FSDP2, "--fsdp-units", "layer", "--prefetch", "1"],
            "fsdp2-root": [*FSDP2, "--fsdp-units", "root"],
        },
        # backward all-gathers within groups of 2 of the 4 ranks (rings over subgroups)
        4: {"fsdp2-reshard-2": [*FSDP2, "--fsdp-units", "layer", "--reshard-after-forward", "2"]},
    },
}


def train_in_ranks(tmp_path: Path, ranks: int, variants: dict, *flags: str) -> dict[str, list]:
    """Every variant in the same ``ranks`` gloo ranks (tests/scripts/train_strategies.py)."""
    script = Path(__file__).parent / "scripts" / "train_strategies.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(script), str(tmp_path), json.dumps(variants), *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: read_metrics(tmp_path / f"{name}.jsonl") for name in variants}


def _events(metrics: list[dict], kind: str) -> list[dict]:
    return [r for r in metrics if r["event"] == kind]


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """Every model and strategy, one launch per world size (1: the single-process reference)."""
    runs = {}
    for ranks in (1, 2, 4):
        variants = {}
        for model, flags in MODELS.items():
            chosen = {"single": ["--strategy", "single"]} if ranks == 1 else VARIANTS[ranks]
            chosen = {**chosen, **EXTRA[model].get(ranks, {})}
            variants.update({f"{model}-{name}": [*flags, *v] for name, v in chosen.items()})
        where = tmp_path_factory.mktemp(f"ranks{ranks}")
        runs[ranks] = train_in_ranks(where, ranks, variants, *PARITY)
    return runs


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_strategy_matches_one_process_at_every_step(parity, model):
    (ref,) = [m for name, m in parity[1].items() if name == f"{model}-single"]
    ref_steps, (ref_summary,) = _events(ref, "step"), _events(ref, "summary")
    assert len(ref_steps) == STEPS and ref_steps[-1]["loss"] < ref_steps[0]["loss"]
    ref_bytes = ref_summary["sharded_state_bytes"][0]
    for ranks in (2, 4):
        runs = {k: v for k, v in parity[ranks].items() if k.startswith(f"{model}-")}
        assert len(runs) >= 3
        for name, metrics in runs.items():
            steps, (summary,) = _events(metrics, "step"), _events(metrics, "summary")
            where = f"{name} on {ranks} ranks"
            assert len(steps) == STEPS and summary["world_size"] == ranks, where
            assert_close_lists([s["loss"] for s in steps], [s["loss"] for s in ref_steps], 1e-5)
            norms = [s["grad_norm"] for s in steps]
            assert_close_lists(norms, [s["grad_norm"] for s in ref_steps], 1e-4 * max(norms))
            assert summary["final_test_loss"] == pytest.approx(
                ref_summary["final_test_loss"], abs=1e-5
            ), where
            # DDP holds everything; FSDP1/FSDP2 shard over dp_shard (HSDP: its inner dimension).
            shard = 1 if name.endswith("-ddp") else summary["mesh"]["shape"][-1]
            for held in summary["sharded_state_bytes"]:
                assert held == pytest.approx(ref_bytes / shard, rel=0.03), (where, held)


@pytest.mark.compat
@pytest.mark.slow  # five launches; the resume matrix moves FSDP1 checkpoints to FSDP2 as well
def test_checkpoints_move_between_fsdp1_fsdp2_ddp_and_single(tmp_path):
    """The migration path: a DCP checkpoint of any strategy resumes under any other, exactly."""
    common = ["--model", "mlp", *TINY, "--max-steps", "12", "--log-every-steps", "1"]
    common += ["--global-batch-size", "64", "--optimizer", "adam"]
    two = ["--nproc-per-node", "2"]
    every4 = ["--ckpt-every-steps", "4"]
    ref = train(tmp_path, *common, *FSDP1, *two, "--ckpt-dir", "f1", *every4, name="fsdp1")
    want = {r["step"]: r["loss"] for r in ref.events("step")}
    assert sorted(want) == list(range(1, 13))
    resumed = {
        "fsdp2": train(
            tmp_path,
            *common,
            *FSDP2,
            *two,
            "--resume",
            "f1/step-4",
            "--ckpt-dir",
            "f2",
            *every4,
            name="fsdp2",
        ),
        "fsdp1": train(tmp_path, *common, *FSDP1, *two, "--resume", "f2/step-8", name="back"),
        "ddp": train(
            tmp_path, *common, "--strategy", "ddp", *two, "--resume", "f1/step-4", name="ddp"
        ),
        "single": train(
            tmp_path, *common, "--strategy", "single", "--resume", "f2/step-8", name="one"
        ),
    }
    assert "saved by fsdp1 on 2 rank(s)" in resumed["fsdp2"].stdout
    assert "saved by fsdp2 on 2 rank(s)" in resumed["fsdp1"].stdout
    for name, run in resumed.items():
        got = {r["step"]: r["loss"] for r in run.events("step")}
        assert got and max(got) == 12 and min(got) in (5, 9), name
        assert_close_lists(list(got.values()), [want[s] for s in got], 1e-5)
        assert run.summary["final_test_loss"] == pytest.approx(
            ref.summary["final_test_loss"], abs=1e-5
        ), name


def test_fsdp1_settings_follow_the_fsdp2_flags():
    assert fsdp1.sharding_strategy(True, hybrid=False) == ShardingStrategy.FULL_SHARD
    assert fsdp1.sharding_strategy(False, hybrid=False) == ShardingStrategy.SHARD_GRAD_OP
    assert fsdp1.sharding_strategy(True, hybrid=True) == ShardingStrategy.HYBRID_SHARD
    assert fsdp1.sharding_strategy(False, hybrid=True) == ShardingStrategy._HYBRID_SHARD_ZERO2
    assert fsdp1.mixed_precision("fp32") is None
    bf16 = fsdp1.mixed_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    model, units = _units("cnn")
    per_unit = fsdp1.wrap_policy(units, None)
    wrapped = [m for m in model.modules() if per_unit(module=m, recurse=False, nonwrapped_numel=0)]
    assert wrapped == units
    by_size = fsdp1.wrap_policy(units, 100_000)
    assert by_size(module=model.fc1, recurse=False, nonwrapped_numel=model.fc1.weight.numel())
    assert not by_size(module=model.fc2, recurse=False, nonwrapped_numel=1290)


def _meta(name: str, **kw):
    cfg = TrainConfig(model=name, **kw)
    return build_on_meta(lambda: get_spec(name).build(cfg))


def _units(name: str, **kw) -> tuple:
    """A meta model and its sharding units, as modules."""
    model = _meta(name, **kw)
    return model, [model.get_submodule(u) for u in get_spec(name).units(model)]


def test_fsdp2_unit_policies_group_consecutive_units():
    # conv1 320, conv2 18,496, fc1 1,179,776, fc2 1,290 parameters
    _, units = _units("cnn")
    assert unit_groups(units, "layer", 1) == [[u] for u in units]
    assert unit_groups(units, "root", 1) == []
    # conv1 + conv2 + fc1 reach the threshold; fc2, too small alone, joins them: one group,
    # which is left to the root.
    assert unit_groups(units, "auto", 100_000) == []
    assert unit_groups(units, "auto", 10_000) == [units[:2], units[2:]]
    _, gpt = _units("gpt", n_layers=4, d_model=256)  # 787,456 parameters a block
    assert unit_groups(gpt, "auto", 1_000_000) == [gpt[:2], gpt[2:]]
    assert unit_groups(gpt, "auto", 500_000) == [[b] for b in gpt]
    assert unit_groups(gpt, "auto", 2_000_000) == []  # 2 + 2 blocks: one group, to the root
    assert unit_groups(gpt, "auto", 10**9) == []
    # The default: ~4 M parameters per unit on CPU (gloo), ~1 M on GPUs (NCCL).
    assert default_unit_min_params("cpu") == 4_000_000
    assert default_unit_min_params("cuda") == 1_000_000


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--strategy", "ddp", "--cpu-offload"], "--cpu-offload offloads sharded state"),
        (
            ["--strategy", "fsdp1", "--reshard-after-forward", "2", "--nproc-per-node", "4"],
            "--strategy fsdp1 has no equivalent of --reshard-after-forward 2",
        ),
        (["--strategy", "fsdp1", "--fsdp1-min-params", "0"], "--fsdp1-min-params must be >= 1"),
        (["--fsdp-unit-min-params", "0"], "--fsdp-unit-min-params must be >= 1"),
        (["--fsdp-units", "layers"], "--fsdp-units"),
    ],
)
def test_bad_strategy_flags_are_one_clear_error(capsys, flags, message):
    """Caught before any worker starts: exit code 2 and one message, no traceback."""
    try:
        code = cli.main(["train", "--model", "mlp", "--dataset", "synthetic", *flags])
    except SystemExit as e:  # argparse: a value outside the choices
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
