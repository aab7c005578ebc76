"""Tensor, pipeline and model parallelism through the CLI: parity with one process, metrics,
memory per rank, and checkpoints that move between TP and FSDP-only runs.

Every run is fp32 with dropout 0; per-step losses must match single-process training within 1e-5.
"""

from __future__ import annotations

import pytest

from conftest import GPT_TINY, TINY, Run, assert_close_lists, read_metrics, run_variants, train
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.models import get_spec
from fsdp2lab.models.materialize import build_on_meta

FAST = [*TINY, "--synthetic-size", "512", "--global-batch-size", "16"]
FAST += ["--max-steps", "20", "--log-every-steps", "1"]
MODEL_FLAGS = {
    # Clipping (the norm is ~0.7) checks the gradient norm over TP shards and pipeline stages.
    "gpt": [*GPT_TINY, "--max-grad-norm", "0.5"],
    "mlp2": ["--model", "mlp2"],
    "mlp": ["--model", "mlp"],
    "cnn": ["--model", "cnn"],
}
# Parameters that TP keeps whole on every tp rank: layer norms (sequence parallel), row-wise biases.
REPLICATED = {
    "gpt": lambda name: "norm" in name,
    "mlp": lambda name: name in ("fc.2.bias", "fc.4.bias"),
    "mlp2": lambda name: name == "net2.bias",
    "cnn": lambda name: False,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of a model (run once per module, on first use)."""
    runs = {}
    folder = tmp_path_factory.mktemp("reference")

    def get(model: str):
        if model not in runs:
            runs[model] = train(
                folder, *MODEL_FLAGS[model], *FAST, "--strategy", "single", name=model
            )
        return runs[model]

    return get


def run(tmp_path, model: str, *args: str, name: str = "run"):
    return train(tmp_path, *MODEL_FLAGS[model], *FAST, *args, name=name)


def assert_parity(got, ref, first_step: int = 0) -> None:
    """Same per-step losses and gradient norms from ``first_step`` (a resumed run) on; where the
    run ends with the reference, the same evaluation; from step 0, the same epoch train loss."""
    n = len(got.step_losses)
    assert_close_lists(got.step_losses, ref.step_losses[first_step : first_step + n], 1e-5)
    norms = [r["grad_norm"] for r in ref.events("step")][first_step : first_step + n]
    assert_close_lists([r["grad_norm"] for r in got.events("step")], norms, 1e-5)
    epoch, ref_epoch = got.events("epoch")[-1], ref.events("epoch")[-1]
    keys = ["test_loss", "test_accuracy"] if epoch["step"] == ref_epoch["step"] else []
    for key in keys + ["train_loss"] * (first_step == 0):
        assert epoch[key] == pytest.approx(ref_epoch[key], abs=1e-5), key


def sizes(model: str) -> tuple[int, int, int]:
    """(parameters, parameter tensors, parameters TP replicates) of the model of MODEL_FLAGS."""
    cfg = config_from_args(build_parser().parse_args(["train", *MODEL_FLAGS[model]]))
    params = dict(build_on_meta(lambda: get_spec(model).build(cfg)).named_parameters())
    replicated = sum(p.numel() for n, p in params.items() if REPLICATED[model](n))
    return sum(p.numel() for p in params.values()), len(params), replicated


def expected_state_bytes(model: str, tp: int = 1, dp: int = 1) -> int:
    """All ranks' parameters + gradients + Adadelta's two states, fp32 (16 bytes per element),
    TP-replicated parameters counted once per tp rank, plus Adadelta's 4-byte step counter per
    tensor on each rank that holds a piece of it (tp x dp ranks of its stage)."""
    params, tensors, replicated = sizes(model)
    return 16 * (params + (tp - 1) * replicated) + 4 * tensors * tp * dp


def assert_state_bytes(got, model: str, tp: int = 1, dp: int = 1) -> None:
    assert sum(got.summary["sharded_state_bytes"]) == expected_state_bytes(model, tp, dp)


@pytest.mark.compat
def test_tp_gpt_parity_memory_and_checkpoints_across_tp_and_fsdp(tmp_path, reference):
    ref = reference("gpt")
    # TP checkpoint (step 10) -> FSDP-only run to step 15 -> TP run to step 20: the same losses.
    # The three runs one after another in the same 2 ranks (run_variants).
    tp_dir, fsdp_dir = str(tmp_path / "tp"), str(tmp_path / "fsdp")
    variants = {
        "tp": {"flags": ["--tp", "2", "--ckpt-dir", tp_dir, "--ckpt-every-steps", "10"]},
        "fsdp": {"flags": ["--max-steps", "15", "--resume", f"{tp_dir}/step-10",
                           "--ckpt-dir", fsdp_dir, "--ckpt-every-steps", "5"]},
        "back": {"flags": ["--tp", "2", "--resume", fsdp_dir]},
    }  # fmt: skip
    run_variants(tmp_path, 2, variants, [*MODEL_FLAGS["gpt"], *FAST])
    tp, fsdp, back = (Run(0, "", "", read_metrics(tmp_path / f"{n}.jsonl")) for n in variants)
    assert_parity(tp, ref)
    s = tp.summary
    assert s["label"] == "tp2" and s["mesh"] == {"shape": [1, 2], "names": ["dp_shard", "tp"]}
    params, tensors, replicated = sizes("gpt")
    per_rank = 16 * ((params - replicated) // 2 + replicated) + 4 * tensors
    assert s["sharded_state_bytes"] == [per_rank, per_rank]
    assert fsdp.summary["mesh"] == {"shape": [2], "names": ["dp_shard"]}
    assert_parity(fsdp, ref, first_step=10)
    assert_parity(back, ref, first_step=15)
    assert back.summary["label"] == "tp2"


def test_2d_fsdp_tp_gpt_four_ranks(tmp_path, reference):
    got = run(tmp_path, "gpt", "--nproc-per-node", "4", "--tp", "2")
    assert_parity(got, reference("gpt"))
    assert got.summary["label"] == "fsdp2+tp2"
    assert got.summary["mesh"]["names"] == ["dp_shard", "tp"]
    assert_state_bytes(got, "gpt", tp=2, dp=2)


def test_tp_mlp_reduce_scatter_plan(tmp_path, reference):
    got = run(tmp_path, "mlp", "--nproc-per-node", "2", "--tp", "2")
    assert_parity(got, reference("mlp"))
    assert_state_bytes(got, "mlp", tp=2)


def test_tp_mixed_precision_bf16(tmp_path, reference):
    got = run(tmp_path, "gpt", "--nproc-per-node", "2", "--tp", "2", "--mixed-precision", "bf16")
    # bf16 compute: close to fp32, not equal.
    assert_close_lists(got.step_losses, reference("gpt").step_losses, 2e-2)
    assert got.step_losses != reference("gpt").step_losses


@pytest.mark.compat
def test_pp_gpt_1f1b(tmp_path, reference):
    got = run(tmp_path, "gpt", "--nproc-per-node", "2", "--pp", "2", "--pp-schedule", "1f1b")
    assert_parity(got, reference("gpt"))
    assert got.summary["label"] == "pp2"
    assert_state_bytes(got, "gpt")


@pytest.mark.compat
def test_pp_with_fsdp_gpipe_four_ranks(tmp_path, reference):
    args = ["--nproc-per-node", "4", "--pp", "2", "--pp-schedule", "gpipe"]
    got = run(tmp_path, "gpt", *args, "--pp-microbatches", "2")
    assert_parity(got, reference("gpt"))
    assert got.summary["label"] == "pp2+fsdp2"
    assert got.summary["mesh"]["names"] == ["pp", "dp_shard"]
    assert_state_bytes(got, "gpt", dp=2)


def test_pp_with_tp_mlp2_four_ranks(tmp_path, reference):
    got = run(tmp_path, "mlp2", "--nproc-per-node", "4", "--pp", "2", "--tp", "2")
    assert_parity(got, reference("mlp2"))
    assert got.summary["label"] == "pp2+tp2"
    assert_state_bytes(got, "mlp2", tp=2)


@pytest.mark.slow
def test_pp_with_tp_gpt_four_ranks(tmp_path, reference):
    """The last stage's logits sharded on the vocabulary, the loss vocabulary-parallel."""
    got = run(tmp_path, "gpt", "--nproc-per-node", "4", "--pp", "2", "--tp", "2")
    assert_parity(got, reference("gpt"))
    assert got.summary["label"] == "pp2+tp2"


@pytest.mark.compat
def test_pp_cnn_with_gradient_accumulation(tmp_path, reference):
    args = [
        "--nproc-per-node",
        "2",
        "--pp",
        "2",
        "--pp-schedule",
        "gpipe",
        "--grad-accum-steps",
        "2",
    ]
    got = run(tmp_path, "cnn", *args)
    # Accumulating two halves of each batch is the same step as one whole batch.
    assert_parity(got, reference("cnn"))


def test_model_parallel_mlp2(tmp_path, reference):
    got = run(tmp_path, "mlp2", "--strategy", "model-parallel")
    assert "fsdp2lab: model-parallel: [net1, relu] on cpu; [net2] on cpu" in got.stdout
    assert_parity(got, reference("mlp2"))
    assert got.summary["label"] == "model-parallel"
    assert_state_bytes(got, "mlp2")


def test_usage_error_is_reported_once_before_workers_start(tmp_path):
    got = train(tmp_path, *MODEL_FLAGS["gpt"], *FAST, "--nproc-per-node", "2", "--tp", "2",
                "--n-heads", "2", "--d-model", "30", "--vocab-size", "255", check=False)  # fmt: skip
    assert got.returncode == 2
    assert got.stderr.count("fsdp2lab: error:") == 1
    assert "not divisible: --vocab-size 255" in got.stderr
