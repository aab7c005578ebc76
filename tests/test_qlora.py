"""``--quantize-base nf4`` (QLoRA): LoRA adapters on a frozen NF4 base, sharded by FSDP2.

16 steps of a tiny gpt with QLoRA on FSDP2 (2 ranks, gloo, with activation checkpointing; 1 rank)
and on HSDP (2 x 2, 2 x 1) follow one process (``--strategy single``) within 1e-5; on every rank each decoder
layer's linear weights are torchao NF4Tensors, frozen, without gradient or optimizer state, bit for
bit the same after training; every adapter of every layer moved; the run's parameter bytes per rank
are NF4's.

Checkpoints: the 2-rank run saves at step 8 (the adapters and their optimizer state, and the base's
quantization record); resumed on 2 ranks, the loaded state is the saved one tensor by tensor and
steps 9-16 are the straight run's bit for bit; with one optimizer row zeroed after loading (the
negative control) both checks fail. Resumed in one process it stays within twice the gap so far
between the 2-rank and the one-process straight runs (tests/scripts/resume_matrix.py). A record
that differs (block sizes, seed, a quantized base against an unquantized one, both ways) is refused
in one line, exit code 2.

On one shard rank (one process, or HSDP 2 x 1) FSDP2 leaves the NF4 base whole and follows the one
process too. What QLoRA does not support yet (there, --cpu-offload) is refused in one line before
any worker starts (exit code 2).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import assert_close_lists, cli_env, read_metrics, run_cli, run_variants
from fsdp2lab.checkpoint import state as ckpt_state
from fsdp2lab.checkpoint.layout import Checkpoint
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models import quantize
from fsdp2lab.plan import resolve

pytestmark = [pytest.mark.hf]
pytest.importorskip("torchao")
pytest.importorskip("peft")

SCRIPT = Path(__file__).parent / "scripts" / "qlora_state.py"
LAYERS = 2
TARGETS = ["wq", "wk", "wv", "wo", "up", "down"]
# d_model 256: every projection holds a multiple of 2 x 16,384 values (two ranks' NF4 blocks).
GPT = {"model": "gpt", "d_model": 256, "n_layers": LAYERS, "n_heads": 4, "seq_len": 16,
       "dataset": "synthetic", "lora_rank": 4, "lora_targets": ",".join(TARGETS),
       "quantize_base": "nf4"}  # fmt: skip
FLAGS = ["--model", "gpt", "--d-model", "256", "--n-layers", str(LAYERS), "--n-heads", "4",
         "--seq-len", "16", "--dataset", "synthetic", "--synthetic-size", "256",
         "--global-batch-size", "16", "--max-steps", "16", "--lora-rank", "4", "--lora-targets",
         ",".join(TARGETS), "--quantize-base", "nf4", "--optimizer", "adamw", "--lr", "1e-2",
         "--scheduler", "constant", "--log-every-steps", "1", "--progress", "off",
         "--dropout", "0"]  # fmt: skip


def qlora_run(tmp_path: Path, name: str, ranks: int, *extra: str) -> tuple[list, list, dict]:
    """(each rank's report from qlora_state.py, the step losses, the summary) of one run."""
    out, metrics = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(SCRIPT), str(out), *FLAGS, *extra,
           "--metrics-file", str(metrics)]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = read_metrics(metrics)
    losses = [r["loss"] for r in records if r["event"] == "step"]
    (summary,) = [r for r in records if r["event"] == "summary"]
    return json.loads(out.read_text()), losses, summary


def nf4_param_bytes(summary: dict, shards: int) -> int:
    """A rank's parameter bytes with the layers' projections (12 x 256 x 256 values a layer) in
    NF4: 4 bits a value, an int8 scale per 64 values, an fp32 factor per 64 x 256, and on each
    rank the fp32 mean and the 16 fp32 levels of each weight; the rest fp32, all split evenly."""
    quantized, weights = 12 * 256 * 256 * LAYERS, 6 * LAYERS
    nf4 = quantized // 2 + quantized // 64 + 4 * quantized // (64 * 256)
    rest = 4 * (summary["params_total"] - quantized)
    return (nf4 + rest) // shards + weights * 4 * (1 + 16)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[list, list, dict]:
    return qlora_run(tmp_path_factory.mktemp("single"), "single", 1, "--strategy", "single")


@pytest.mark.parametrize(
    ("ranks", "shards", "flags"),
    [
        (2, 2, ["--activation-checkpointing", "full"]),
        (4, 2, ["--dp-replicate", "2"]),
        (1, 1, []),
        (2, 1, ["--dp-replicate", "2"]),
    ],
    ids=["fsdp2-ac", "hsdp-2x2", "fsdp2-one-rank", "hsdp-2x1"],
)
def test_sharded_follows_one_process_base_frozen_adapters_move(
    tmp_path, single, ranks, shards, flags
):
    """On one shard rank (one process, or replicas only) FSDP2 leaves the NF4 base whole."""
    one, one_losses, one_summary = single
    sharded, sharded_losses, summary = qlora_run(tmp_path, "sharded", ranks, *flags)
    assert len(sharded_losses) == 16
    assert_close_lists(sharded_losses, one_losses, 1e-5)
    assert one_summary["param_bytes"] == [nf4_param_bytes(one_summary, 1)]
    assert summary["param_bytes"] == [nf4_param_bytes(summary, shards)] * ranks
    quantized = {f"blocks.{i}.{part}.{t}.base_layer.weight"
                 for i in range(LAYERS) for part, names in (("attn", TARGETS[:4]), ("mlp", TARGETS[4:]))
                 for t in names}  # fmt: skip
    for report in [*one, *sharded]:  # each rank's
        assert set(report["base"]) == quantized
        for name, facts in report["base"].items():
            assert facts == {"nf4": True, "frozen": True, "unchanged": True}, name
        adapters = report["adapters_moved"]
        assert len(adapters) == 2 * len(quantized)  # lora_A and lora_B of each
        assert all(adapters.values()), [n for n, moved in adapters.items() if not moved]


def plan(**flags):
    return resolve(TrainConfig(**{**GPT, **flags}), 2, "cpu")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"strategy": "ddp"}, "--strategy ddp"),
        ({"strategy": "fsdp1"}, "--strategy fsdp1"),
        ({"tp": 2}, "--tp"),
        ({"pp": 2}, "--pp"),
        ({"save_model": "m.pt"}, "--save-model"),
        ({"activation_checkpointing": "op"}, "--activation-checkpointing op"),
    ],
)
def test_refuses_what_it_does_not_support_yet(flags, named):
    with pytest.raises(UsageError, match=f"--quantize-base does not support {named}"):
        plan(**flags)


def test_refuses_weights_that_do_not_split_into_nf4_blocks():
    plan()  # d_model 256 splits over 2 ranks
    with pytest.raises(
        UsageError, match=r"blocks\.0\.attn\.wq\.base_layer\.weight 128 x 128 .* 32,768"
    ):
        plan(d_model=128)  # 16,384 values: one rank's whole NF4 block, not two


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    proc = run_cli(["train", *FLAGS, "--strategy", "ddp", "--nproc-per-node", "2"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fsdp2lab: error: --quantize-base does not support --strategy ddp yet: use --strategy "
        "fsdp2 (HSDP too) or single"
    ]
    assert not list(tmp_path.iterdir())


def test_one_shard_rank_leaves_the_base_whole_and_refuses_to_offload_it():
    """FSDP2's one-rank all-gather passes on only the first of NF4's parts: on one shard rank
    (one process, or HSDP 2 x 1) the plan names the base's weights for FSDP2 to leave whole, and
    refuses --cpu-offload (which would leave them on the host) in one line, before any worker."""
    names = {f"blocks.{i}.{part}.{t}.base_layer.weight"
             for i in range(LAYERS) for part, targets in (("attn", TARGETS[:4]), ("mlp", TARGETS[4:]))
             for t in targets}  # fmt: skip
    message = (
        r"^--quantize-base nf4 with --cpu-offload needs 2 or more ranks to shard over \(on one "
        r"the NF4 base stays on the GPU, whole\)$"
    )
    for world_size, flags in ((1, {}), (2, {"dp_replicate": 2})):
        assert set(resolve(TrainConfig(**{**GPT, **flags}), world_size, "cpu").unsharded) == names
        with pytest.raises(UsageError, match=message):
            resolve(TrainConfig(**{**GPT, **flags, "cpu_offload": True}), world_size, "cpu")
    assert resolve(TrainConfig(**GPT), 2, "cpu").unsharded == ()
    resolve(TrainConfig(**GPT, strategy="single"), 1, "cpu")


def test_a_hf_llama_quantizes_its_layers_projections_only(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    cfg = TrainConfig(model=f"hf:{tmp_path / 'llama'}", lora_rank=4, quantize_base="nf4")
    run = resolve(cfg, 2, "cpu")
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    assert [name for name, _ in quantize.base_linears(run.meta_model, run.units)] == [
        f"model.layers.{i}.{p}.base_layer" for i in range(2) for p in projections
    ]
    assert not run.strategy.materialize_first  # NF4 on meta, sharded, each shard quantized as read


# ---------------------------------------------------------------------------- checkpoints
SAVE_AT = 8


@pytest.fixture(scope="module")
def resumes(tmp_path_factory) -> Path:
    """On 2 ranks: the straight run saving at step 8, its resume, and its resume with one
    optimizer row zeroed after loading; in one process: the resume of that checkpoint."""
    out = tmp_path_factory.mktemp("resume")
    ckpt = str(out / "ckpt" / f"step-{SAVE_AT}")
    resume = {"flags": ["--resume", ckpt], "check": ckpt}
    saving = ["--ckpt-dir", str(out / "ckpt"), "--ckpt-every-steps", str(SAVE_AT)]
    variants = {"straight": {"flags": saving}, "resumed": resume,
                "mutated": {**resume, "mutate": "optim-row"}}  # fmt: skip
    run_variants(out, 2, variants, FLAGS)
    one = {"one-resumed": {**resume, "flags": [*resume["flags"], "--strategy", "single"]}}
    run_variants(out, 1, one, FLAGS)
    return out


def step_losses(out: Path, name: str) -> list[float]:
    return [r["loss"] for r in read_metrics(out / f"{name}.jsonl") if r["event"] == "step"]


def state_reports(out: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((out / f"{name}.state.rank{r}.json").read_text()) for r in range(ranks)]


def test_checkpoint_holds_adapters_and_the_quantization_record(resumes):
    marker = json.loads((resumes / "ckpt" / f"step-{SAVE_AT}" / "COMPLETE").read_text())
    assert marker["quantized_base"] == {"scheme": "nf4", "block": 64, "scaler_block": 256,
                                        "source": {"seed": TrainConfig().seed}}  # fmt: skip
    (report, _) = state_reports(resumes, "resumed", 2)
    model_keys = [k for k in report["expected"] if k.startswith("model.")]
    assert len(model_keys) == 2 * 6 * LAYERS and all("lora_" in k for k in model_keys)


def test_resume_is_exact_at_the_same_layout_and_a_changed_row_is_caught(resumes):
    straight, resumed = step_losses(resumes, "straight"), step_losses(resumes, "resumed")
    assert len(straight) == 16 and resumed == straight[SAVE_AT:]  # bit for bit
    for report in state_reports(resumes, "resumed", 2):
        assert report["mismatched"] == [] and set(report["expected"]) <= set(report["compared"])
    assert step_losses(resumes, "mutated") != straight[SAVE_AT:]
    for report in state_reports(resumes, "mutated", 2):
        (changed,) = report["mismatched"]
        assert changed.startswith("optim.state.") and "lora_" in changed, changed


def test_resume_in_one_process_stays_within_the_straight_runs_gap(resumes, single):
    _, one_losses, _ = single
    straight, resumed = step_losses(resumes, "straight"), step_losses(resumes, "one-resumed")
    assert len(resumed) == 16 - SAVE_AT
    gap = max(abs(a - b) for a, b in zip(straight[:SAVE_AT], one_losses[:SAVE_AT], strict=True))
    for step, loss in enumerate(resumed, SAVE_AT):
        gap = max(gap, abs(straight[step] - one_losses[step]))
        assert abs(loss - one_losses[step]) <= max(1e-6, 2 * gap), (step, loss, gap)
    (report,) = state_reports(resumes, "one-resumed", 1)
    assert report["mismatched"] == [] and set(report["expected"]) <= set(report["compared"])


def test_a_changed_quantization_record_is_refused_in_one_line(resumes, tmp_path):
    edited = tmp_path / "ckpt" / f"step-{SAVE_AT}"
    shutil.copytree(resumes / "ckpt" / f"step-{SAVE_AT}", edited)
    marker = json.loads((edited / "COMPLETE").read_text())
    marker["quantized_base"]["block"] = 128
    (edited / "COMPLETE").write_text(json.dumps(marker))
    proc = run_cli(["train", *FLAGS, "--strategy", "single", "--nproc-per-node", "1",
                    "--resume", str(edited)], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    seed = TrainConfig().seed
    assert proc.stderr.strip().splitlines()[-1:] == [
        f"fsdp2lab: error: checkpoint {edited} was trained on an nf4 base (blocks of 128, scales "
        f"in blocks of 256) of the model built from seed {seed}; this run has an nf4 base "
        f"(blocks of 64, scales in blocks of 256) of the model built from seed {seed}"
    ]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1, errors


@pytest.mark.parametrize(
    ("saved_seed", "flags", "words"),
    [
        (2, {}, r"an nf4 base .* seed 2; this run has an nf4 base .* seed 1$"),
        (None, {}, r"an unquantized base \(no --quantize-base\); this run has an nf4 base .*"),
        (1, {"quantize_base": None}, r"an nf4 base .* seed 1; this run has an unquantized base"),
    ],
    ids=["seed", "lora-checkpoint-qlora-run", "qlora-checkpoint-lora-run"],
)
def test_base_records_that_differ_are_refused(saved_seed, flags, words):
    def ckpt(seed: int | None) -> Checkpoint:
        run = {"contents": ["model", "optim"]}
        if seed is not None:
            run["quantized_base"] = quantize.record("nf4", None, seed)
        return Checkpoint(Path("ck/step-8"), run, None)

    def trainer(**changes) -> SimpleNamespace:
        cfg = TrainConfig(**{**GPT, "seed": 1, **changes})
        return SimpleNamespace(cfg=cfg, plan=SimpleNamespace(spec=SimpleNamespace(source=None)))

    with pytest.raises(UsageError, match=r"^checkpoint ck/step-8 was trained on " + words):
        ckpt_state.check_base(trainer(**flags), ckpt(saved_seed))
    ckpt_state.check_base(trainer(), ckpt(1))  # the same record passes
