"""``fsdp2lab plan`` against real runs here: the trainer's own steps on CPU ranks (gloo),
measured by torch's profiler (tests/scripts/scale_measure.py), not by anything the plan
simulates with; and the sharded state, byte for byte, as the trainer reports it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPT_TINY, TINY, cli_env, run_cli, train
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale.simulate import simulate, stage_ranks

ROOT = Path(__file__).resolve().parents[1]
MEASURE = ROOT / "tests" / "scripts" / "scale_measure.py"
# --max-grad-norm: every step takes the gradient norm (its all-reduce), as the plan models it
GPT = [*GPT_TINY, "--d-model", "64", "--seq-len", "64", "--batch-size", "4", "--optimizer", "adamw",
       "--max-grad-norm", "1.0"]  # fmt: skip
USER = ["--model", str(ROOT / "examples" / "my_model.py:build"), "--model-args", "width=64,depth=4",
        "--input-shape", "1,28,28", "--batch-size", "8", "--optimizer", "adamw",
        "--max-grad-norm", "1.0"]  # fmt: skip
MLP = ["--model", "mlp", "--batch-size", "16", "--optimizer", "adamw", "--max-grad-norm", "1.0"]
CNN = ["--model", "cnn", "--batch-size", "16", "--optimizer", "adam", "--max-grad-norm", "1.0"]
# The gradient norm's all-reduce over a one-rank data-parallel group (the squared norm and the
# NaN guard's flag riding on it: two floats): gloo runs it, the plan counts only collectives
# between ranks.
ONE_RANK_NORM = {"all_reduce": [1, 8]}


def plan_of(world: int, flags: list[str]):
    return resolve(config_from_args(build_parser().parse_args(["train", *flags])), world)


def measure(world: int, flags: list[str]) -> list[dict]:
    """For the first rank of each pipeline stage (one without --pp) of a real run on ``world``
    gloo ranks: the optimizer state its first step made, and each measured step's allocator
    peak and gloo collectives (tests/scripts/scale_measure.py)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(MEASURE),
            *TINY,
            "--device",
            "cpu",
            *flags,
        ],  # fmt: skip
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["stages"]


def on_gloo(plan, role) -> dict[str, list[int]]:
    """The plan's collectives as gloo runs them, summed over mesh dimensions: {kind: [calls,
    input bytes]}. gloo has no reduce-scatter: torch runs one as an all-reduce of its input (where
    FSDP2 takes no custom reduce-scatter: torch 2.8); an all-gather's input is 1/n of the output
    the plan counts."""
    sizes = dict(plan.dims.named_dims())
    out: dict[str, list[int]] = {}
    for dim, kinds in role.comm.items():
        for kind, c in kinds.items():
            nbytes = c.tensor_bytes // sizes[dim] if kind == "all_gather" else c.tensor_bytes
            entry = out.setdefault("all_reduce" if kind == "reduce_scatter" else kind, [0, 0])
            entry[0] += c.calls
            entry[1] += nbytes
    return out


def _add(comm: dict, extra: dict) -> dict:
    return {k: [a + b for a, b in zip(comm.get(k, [0, 0]), extra.get(k, [0, 0]), strict=True)]
            for k in {*comm, *extra}}  # fmt: skip


# (world, flags, collectives the plan leaves out, plan peak / real peak for each stage). The
# ratio is this machine's: the plan tracks tensors as FSDP2's memory tracker sees them, the real
# run counts every block the step's code allocates; each case is pinned to its own, within 2%
# (mlp's and cnn's traced: test_mlp_and_cnn_gaps_are_the_plans_input_batch_and_hidden_blocks).
CASES = [
    pytest.param(2, GPT, {}, (1.000,), id="gpt-fsdp2-2", marks=pytest.mark.slow),
    pytest.param(2, USER, {}, (1.009,), id="user-fsdp2-2", marks=pytest.mark.slow),
    pytest.param(1, GPT, ONE_RANK_NORM, (1.000,), id="gpt-fsdp2-1", marks=pytest.mark.slow),
    pytest.param(4, GPT, {}, (1.001,), id="gpt-fsdp2-4", marks=pytest.mark.slow),
    pytest.param(
        4, [*GPT, "--dp-replicate", "2"], {}, (1.000,), id="gpt-hsdp-2x2", marks=pytest.mark.slow
    ),  # fmt: skip
    pytest.param(
        2, [*GPT, "--tp", "2"], {}, (1.001,), id="gpt-tp-2", marks=pytest.mark.slow
    ),  # fmt: skip
    pytest.param(
        2,
        [*GPT, "--activation-checkpointing", "full", "--mixed-precision", "bf16"],
        {},
        (0.963,),
        id="gpt-fsdp2-2-ac-bf16",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(
        2,
        [*GPT, "--activation-checkpointing", "op", "--mixed-precision", "bf16"],
        {},
        (0.997,),
        id="gpt-fsdp2-2-op-bf16",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(2, MLP, {}, (1.029,), id="mlp-fsdp2-2", marks=pytest.mark.slow),
    pytest.param(2, CNN, {}, (1.002,), id="cnn-fsdp2-2", marks=pytest.mark.slow),
    pytest.param(
        4,
        [*USER, "--dp-replicate", "2"],
        {},
        (1.009,),
        id="user-hsdp-2x2",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    # --pp: every stage planned (its own rank role) and measured on the real Pipeline
    pytest.param(
        2,
        [*GPT, "--pp", "2", "--pp-schedule", "1f1b"],
        ONE_RANK_NORM,
        (1.017, 0.976),
        id="gpt-pp-2-1f1b",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(
        2,
        [*GPT, "--pp", "2", "--pp-schedule", "gpipe"],
        ONE_RANK_NORM,
        (1.023, 1.001),
        id="gpt-pp-2-gpipe",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(
        4,
        [*GPT, "--pp", "2", "--pp-schedule", "1f1b"],
        {},
        (1.021, 0.970),
        id="gpt-pp-2-fsdp2-2-1f1b",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(
        4,
        [*GPT, "--pp", "2", "--tp", "2"],
        {},
        (1.016, 0.979),
        id="gpt-pp-2-tp-2",
        marks=pytest.mark.slow,
    ),  # fmt: skip
]


@pytest.mark.parametrize("world, flags, left_out, ratios", CASES)
def test_plan_matches_real_trainer(world, flags, left_out, ratios):
    """The real trainer's steps against the plan, for every stage: the optimizer state its first
    step makes (allocator bytes) and each step's collectives (gloo's own records: calls and
    bytes by kind) equal; every measured step's peak the same, at the case's own ratio within
    2%."""
    plan = plan_of(world, flags)
    planned = [simulate(plan, rank=rank, device_type="cpu") for rank in stage_ranks(plan)]
    real = measure(world, flags)
    assert len(real) == len(planned) == len(ratios)
    for p, r, ratio in zip(planned, real, ratios, strict=True):
        assert r["optimizer_state_bytes"] == p.state["optimizer_state_bytes"], p.stage
        expected = _add(on_gloo(plan, p), left_out)
        for step in r["steps"]:
            assert step["comm"] == expected, (p.stage, step["comm"], expected)
        peaks = [step["peak_bytes"] for step in r["steps"]]
        assert len(set(peaks)) == 1, (p.stage, peaks)
        assert ratio * 0.98 <= p.peak_bytes / peaks[0] <= ratio * 1.02, (
            p.stage, p.peak_bytes / peaks[0])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("flags", [MLP, CNN], ids=["mlp", "cnn"])
def test_mlp_and_cnn_gaps_are_the_plans_input_batch_and_hidden_blocks(flags):
    """Where the mlp's and cnn's plan/real ratios (1.029, 1.002) come from: the real peak is the
    plan's peak less its ``inputs``, the batch the plan tracks beside the one the step draws, and
    the 512 bytes of unsharded gradients the plan holds there, exactly; no block allocated inside
    an operator's own C++ code is live at it (``scale_measure.hidden_ranges``). Where FSDP2 takes
    no custom reduce-scatter (torch 2.8), gloo's staging copy of the reduce-scatter's input (and
    the cnn's convolution backward workspace) is: the peak seen without those blocks is then the
    plan's less its ``inputs``."""
    from torch.distributed.fsdp import FSDPModule

    plan = simulate(plan_of(2, flags), device_type="cpu")
    (real,) = measure(2, flags)
    assert plan.peak_by_category["inputs"] == 16 * 28 * 28 * 4  # one batch of 16 images
    beside = plan.peak_bytes - plan.peak_by_category["inputs"]
    for step in real["steps"]:
        if hasattr(FSDPModule, "set_custom_reduce_scatter"):
            assert plan.peak_by_category["unsharded_grads"] == 512
            assert step["seen_peak_bytes"] == step["peak_bytes"] == beside - 512
        else:
            assert step["seen_peak_bytes"] < step["peak_bytes"]
            assert step["seen_peak_bytes"] == beside


def test_plan_state_equals_trainer_metrics(tmp_path):
    """The trainer's own per-rank param/grad/optimizer-state bytes (its metrics file's summary)."""
    flags = [*TINY, *GPT, "--max-steps", "2", "--nproc-per-node", "2", "--device", "cpu"]
    summary = train(tmp_path, *flags).summary
    planned = simulate(plan_of(2, flags), device_type="cpu")
    for key, value in planned.state.items():
        assert summary[key] == [value, value], (key, summary[key], value)


LLAMA = str(ROOT / "tests" / "fixtures" / "llama3.py")


def test_plan_op_ac_is_the_fixtures_own_per_op_ac():
    """``--activation-checkpointing op`` on the Llama fixture without its own AC (``sac="none"``)
    plans the same peak and FLOPs, to the byte, as the fixture's own per-op AC (``sac="op"``:
    torchtitan's, in the model's code): the flag is what torchtitan published. It sits between
    no AC and full AC, in memory and in recomputed FLOPs. The gpt's plan takes the flag too."""
    size = "vocab=512,dim=128,n_layers=2,n_heads=4,n_kv_heads=2,hidden=256,max_seq=64"
    flags = ["--model", f"{LLAMA}:build", "--loss", f"{LLAMA}:loss", "--vocab-size", "512",
             "--seq-len", "64", "--batch-size", "2", "--mixed-precision", "bf16"]  # fmt: skip

    def plan(sac: str, ac: str):
        args = [*flags, "--model-args", f'{size},sac="{sac}"', "--activation-checkpointing", ac]
        return simulate(plan_of(2, args))

    own, flag = plan("op", "none"), plan("none", "op")
    assert (flag.peak_bytes, flag.flops) == (own.peak_bytes, own.flops)
    none, full = plan("none", "none"), plan("none", "full")
    assert full.peak_bytes < flag.peak_bytes < none.peak_bytes
    assert none.flops < flag.flops < full.flops
    assert flag.forward_flops == none.forward_flops
    text = run_cli(["plan", *GPT, "--world-size", "8", "--activation-checkpointing", "op"])
    assert text.returncode == 0, text.stderr
    assert ", AC op" in text.stdout


def test_plan_json_at_scale():
    """64 GPUs, HSDP 8 x 8: the --json object's figures, per mesh dimension."""
    flags = ["--world-size", "64", "--dp-replicate", "8", "--cpu-offload", "--json"]
    proc = run_cli(["plan", *GPT, *flags])
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["not_modelled"] == []  # --cpu-offload: the state on the host (test_plan_offload)
    assert r["host_bytes_per_rank"] == r["state_bytes_per_rank"]
    for key in ("peak_bytes_per_rank", "state_bytes_per_rank", "comm_bytes_per_step", "step_s",
                "tokens_per_s_per_gpu", "mfu", "fits"):  # fmt: skip
        assert key in r, key
    assert r["fits"] is True and r["mesh"] == {"dp_replicate": 8, "dp_shard": 8}
    assert set(r["comm_bytes_per_step"]) == {"dp_replicate", "dp_shard"}
    # 8 shards of fp32 parameters; AdamW's state is twice that (and a step counter per tensor)
    params = r["params_total"]
    state = r["roles"][0]["state"]
    assert abs(state["param_bytes"] - 4 * params / 8) <= 4 * 8 * 64  # padding to 8 shards
    assert state["grad_bytes"] == state["param_bytes"]
    # 8 replicas across 8 nodes: the all-reduce crosses nodes, the shards stay within one
    comm = r["roles"][0]["comm"]
    assert comm["dp_replicate"]["across_nodes"] and not comm["dp_shard"]["across_nodes"]


def test_plan_pp_roles():
    """--pp 2: two rank roles, one per stage, each with its modules and state; the --json object
    has the per-role list, the worst role's peak, the pipeline and its bubble in the step time."""
    proc = run_cli(["plan", *GPT, "--world-size", "4", "--pp", "2", "--pp-schedule", "gpipe",
                    "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    roles = r["roles"]
    assert [(role["rank"], role["stage"]) for role in roles] == [(0, 0), (2, 1)]
    assert roles[0]["modules"][0] == "tok_emb" and roles[1]["modules"][-1] == "lm_head"
    assert roles[0]["state_bytes"] != roles[1]["state_bytes"]
    assert r["peak_bytes_per_rank"] == max(role["memory"]["peak_bytes"] for role in roles)
    assert r["state_bytes_per_rank"] == max(role["state_bytes"] for role in roles)
    n = 4  # micro-batches: 2 x stages
    assert r["pipeline"] == {"stages": 2, "schedule": "gpipe", "n_microbatches": n,
                             "microbatch": 1, "bubble_fraction": 1 / 5}  # fmt: skip
    for role in roles:
        t = role["time"]
        assert t["pipeline_bubble_s"] == pytest.approx(t["compute_s"] / n)
        sent = role["comm"]["pp"]["send"]
        # one micro-batch's activations (or their gradients): 1 x 64 positions x 64 fp32
        assert sent["calls"] == n and sent["bytes"] == n * 64 * 64 * 4
    assert set(r["comm_bytes_per_step"]) == {"pp", "dp_shard"}
    text = run_cli(["plan", *GPT, "--world-size", "4", "--pp", "2"])
    assert text.returncode == 0, text.stderr
    assert "rank role 2: pipeline stage 1 [blocks.1, norm, lm_head]" in text.stdout
    assert "pipeline bubble" in text.stdout


def test_plan_that_does_not_fit_lists_alternatives():
    big = ["--model", "gpt", "--n-layers", "4", "--d-model", "8192", "--n-heads", "64",
           "--vocab-size", "32000", "--seq-len", "512", "--batch-size", "1", "--optimizer", "adamw"]  # fmt: skip
    proc = run_cli(
        ["plan", *big, "--world-size", "8", "--dp-replicate", "8", "--gpu", "a100-40gb", "--json"]
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["fits"] is False
    changes = {a["change"]: a for a in r["alternatives"]}
    sharded = changes["shard over all data-parallel ranks (--dp-replicate 1)"]
    assert (
        sharded["fits"] is True and sharded["state_bytes_per_rank"] < r["state_bytes_per_rank"] / 7
    )


def test_plan_bad_input_is_one_line():
    proc = run_cli(["plan", *GPT])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fsdp2lab: error: fsdp2lab plan needs --world-size N (or --nnodes N [--nproc-per-node G])"
    ]
    proc = run_cli(["plan", *GPT, "--world-size", "8", "--gpu", "tpu"])
    assert proc.returncode == 2 and "--gpu 'tpu' is not in the table" in proc.stderr
    proc = run_cli(["plan", *GPT, "--world-size", "8", "--mixed-precision", "fp16"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fsdp2lab: error: fsdp2lab plan does not model --mixed-precision fp16 (its loss scaler); use bf16"
    ]
