"""``--lora-rank R``: PEFT LoRA adapters on a frozen pretrained base, sharded with their layer.

One run per configuration (module fixtures), checked by several tests: 20 steps of LoRA on FSDP2
(2 ranks), HSDP (2 x 2), DDP with activation checkpointing and FSDP1 follow one process within
1e-5, 6 steps of FSDP2 with ``--compile`` follow its eager run within 1e-5, and one process
follows a plain PEFT loop (``get_peft_model`` + ``torch.optim.AdamW``) on the same folder and
batches; the base is bit for bit the folder's after training, every adapter of every layer moved;
only the adapters have gradients and optimizer state. Checkpoints hold the adapters and the base
folder's fingerprint; resume is exact at the same layout (at another world size: the resume
matrix's LoRA cell); another base is refused. Bad input is one line and exit code 2.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_lists, run_cli, saved_checkpoint, train
from fsdp2lab.config import TrainConfig, validate_basic
from fsdp2lab.data import synthetic
from fsdp2lab.data.sampler import epoch_order
from fsdp2lab.errors import UsageError
from fsdp2lab.models import lora
from fsdp2lab.models.materialize import module_seed
from fsdp2lab.plan import resolve
from fsdp2lab.training.optim import build_optimizer

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

STEPS, SEQ, BATCH, LR, RANK, ALPHA = 20, 16, 16, 1e-2, 4, 8
SIZE = STEPS * BATCH  # the 20 steps are one epoch: one sample order
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-dropout", "0"]
FIT = [*LORA, "--max-steps", str(STEPS), "--log-every-steps", "1", "--optimizer", "adamw",
       "--lr", str(LR), "--scheduler", "constant", "--global-batch-size", str(BATCH),
       "--seq-len", str(SEQ), "--synthetic-size", str(SIZE), "--progress", "off"]  # fmt: skip


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def folder(where) -> Path:
    from test_hf_pretrained import save_llama

    return save_llama(where / "llama", tied=False)


def _run(where: Path, folder: Path, name: str, *flags: str, env: dict | None = None):
    return train(where, "--model", f"hf:{folder}", *FIT, *flags, name=name, env=env)


@pytest.fixture(scope="module")
def single(where, folder):
    return _run(where, folder, "single", "--strategy", "single", "--save-model", "single.pt")


@pytest.fixture(scope="module")
def fsdp2(where, folder):
    return _run(where, folder, "fsdp2", "--nproc-per-node", "2", "--save-model", "fsdp2.pt",
                "--ckpt-dir", "ckpt", "--ckpt-every-steps", "10", "--keep-last", "0")  # fmt: skip


def adapter_init(model: torch.nn.Module, seed: int = 1) -> None:
    """fsdp2lab's adapter init, written out: PEFT's own reset per adapted module, seeded by
    (seed, module name)."""
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            torch.manual_seed(module_seed(seed, name))
            with torch.no_grad():
                module.reset_lora_parameters("default", True)


def batches(folder: Path, seed: int = 1):
    """The global batches of the run's steps (one epoch of synthetic tokens)."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    train_set, _ = synthetic.tokens(vocab, SEQ, SIZE, SIZE // 4, seed)
    order = epoch_order(len(train_set), seed, 1)
    for step in range(STEPS):
        yield train_set.__getitems__(order[step * BATCH : (step + 1) * BATCH].tolist())


# ---------------------------------------------------------------------------- parity
def test_sharded_lora_follows_one_process_and_the_loss_falls(where, folder, single, fsdp2):
    assert "(41,888 parameters, 4,096 of them LoRA rank 4 adapters)" in single.stdout
    reference = single.step_losses
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.05, reference
    norms = [r["grad_norm"] for r in single.events("step") + fsdp2.events("step")]
    assert all(math.isfinite(n) and n > 0 for n in norms), norms
    assert_close_lists(fsdp2.step_losses, reference, 1e-5)
    variants = {
        "hsdp": ["--nproc-per-node", "4", "--dp-replicate", "2"],
        "ddp-ac": ["--nproc-per-node", "2", "--strategy", "ddp", "--activation-checkpointing", "full"],
        "fsdp1": ["--nproc-per-node", "2", "--strategy", "fsdp1"],
    }  # fmt: skip
    for name, flags in variants.items():
        assert_close_lists(_run(where, folder, name, *flags).step_losses, reference, 1e-5)


def test_one_process_follows_a_plain_peft_loop(folder, single):
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(base, config)
    adapter_init(model.base_model.model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=0.0)  # fmt: skip
    losses = []
    for x, y in batches(folder):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert_close_lists(single.step_losses, losses, 1e-5)


def test_the_base_is_unchanged_and_every_adapter_moved(where, folder, fsdp2):
    assert_base_unchanged_and_every_adapter_moved(folder, where / "fsdp2.pt")


def assert_base_unchanged_and_every_adapter_moved(folder: Path, model_file: Path) -> None:
    """The model a run saved (``--save-model``): every base tensor bit for bit the folder's, every
    adapter of every layer moved from its initial value."""
    saved = torch.load(model_file, weights_only=True)
    files = {}
    for file in folder.glob("*.safetensors"):
        files.update(safetensors_torch.load_file(file))
    base = {k: v for k, v in saved.items() if not lora.is_adapter(k)}
    assert {lora.base_key(k) for k in base} == set(files)
    changed = [k for k, v in base.items() if not torch.equal(v, files[lora.base_key(k)])]
    assert not changed, changed
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    initial = peft.inject_adapter_in_model(
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS), initial
    )
    adapter_init(initial)
    start = {k: v for k, v in initial.state_dict().items() if lora.is_adapter(k)}
    layers = transformers.AutoConfig.from_pretrained(folder).num_hidden_layers
    assert len(start) == layers * len(TARGETS) * 2 and set(start) == set(saved) - set(base)
    unmoved = [k for k, v in start.items() if torch.equal(saved[k], v)]
    assert not unmoved, unmoved  # lora_B starts at 0 and lora_A gets no gradient before it moves
    assert all(saved[k].abs().sum() > 0 for k in start if "lora_B" in k)


def test_lora_with_compile_follows_eager(where, folder, fsdp2):
    """``--compile`` (inductor, each decoder layer) on FSDP2, 2 ranks: the first 6 steps of the
    eager FSDP2 run within 1e-5 (fused kernels round in another order: the kind of difference the
    sharded runs above are bounded by), the adapters moved, the base unchanged, and inductor
    generated the code (its cache, fresh here, holds the compiled kernels; compiled in each rank's
    process: no worker pool to start on a small CPU box)."""
    steps, cache = 6, where / "inductor"
    run = _run(where, folder, "compile", "--nproc-per-node", "2", "--compile",
               "--max-steps", str(steps), "--save-model", "compile.pt",
               env={"TORCHINDUCTOR_CACHE_DIR": str(cache),
                    "TORCHINDUCTOR_COMPILE_THREADS": "1"})  # fmt: skip
    assert_close_lists(run.step_losses, fsdp2.step_losses[:steps], 1e-5)
    assert list(cache.rglob("*.cpp")), "inductor compiled nothing"
    assert_base_unchanged_and_every_adapter_moved(folder, where / "compile.pt")


def test_only_the_adapters_have_gradients_and_optimizer_state(fsdp2):
    n_adapters = 2 * 2 * len(TARGETS)  # layers x targets x (A, B)
    hidden, kv, mlp = 32, 16, 64  # the tiny Llama: A is [RANK, in], B [out, RANK]
    in_out = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, mlp),
              (hidden, mlp), (mlp, hidden)]  # fmt: skip
    adapter_numel = 2 * RANK * sum(i + o for i, o in in_out)  # 2 layers
    step = fsdp2.events("step")[-1]
    assert step["grad_bytes"] == [4 * adapter_numel // 2] * 2  # fp32, sharded over the 2 ranks
    # AdamW: exp_avg and exp_avg_sq of each adapter shard, and its step count on every rank.
    assert sum(step["optimizer_state_bytes"]) == 2 * 4 * adapter_numel + 2 * 4 * n_adapters


def test_the_optimizer_gets_only_what_trains():
    model = torch.nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    optimizer = build_optimizer(model.parameters(), TrainConfig(optimizer="adamw", lr=0.1))
    assert [p for g in optimizer.param_groups for p in g["params"]] == [model.weight]


@pytest.mark.parametrize(
    ("dtype", "precision", "strategy", "base"),
    [
        (torch.bfloat16, "bf16", "fsdp2", torch.bfloat16),  # no fp32 copy of a bf16 base
        (torch.bfloat16, "fp32", "fsdp2", torch.float32),
        (torch.bfloat16, "bf16", "fsdp1", torch.float32),  # one dtype per flat parameter
        (torch.float32, "bf16", "ddp", torch.float32),
        ("config-only", "bf16", "fsdp2", torch.bfloat16),  # the dtype its config.json names
    ],
)
def test_the_plan_has_the_adapters_on_the_meta_model(
    where, folder, dtype, precision, strategy, base
):
    source = folder
    if dtype == "config-only":
        source = where / "llama-config-only"
        if not source.exists():
            config = transformers.AutoConfig.from_pretrained(folder)
            config.dtype = "bfloat16"
            config.save_pretrained(source)
    elif dtype != torch.float32:
        source = where / "llama-bf16"
        if not source.exists():
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).save_pretrained(
                source
            )
    cfg = TrainConfig(model=f"hf:{source}", lora_rank=RANK, mixed_precision=precision,
                      strategy=strategy, seq_len=SEQ)  # fmt: skip
    plan = resolve(cfg, 2)
    assert plan.cfg.lora_alpha == 2 * RANK and plan.cfg.lora_targets == ",".join(TARGETS)
    assert plan.units == resolve(TrainConfig(model=f"hf:{source}", seq_len=SEQ), 2).units
    params = dict(plan.meta_model.named_parameters())
    adapters = {k: p for k, p in params.items() if lora.is_adapter(k)}
    assert len(adapters) == 2 * 2 * len(TARGETS)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in adapters.values())
    frozen = [p for k, p in params.items() if k not in adapters]
    assert all(not p.requires_grad and p.dtype == base for p in frozen)
    assert lora.trainable_state(plan.meta_model).keys() == adapters.keys()


# ---------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_holds_the_adapters_and_the_base_fingerprint(where, folder, fsdp2):
    ckpt = where / "ckpt" / "step-10"
    state = saved_checkpoint(ckpt)
    assert set(state) >= {"model", "optim", "scheduler", "train_state", "ranks", "run"}
    model_keys = set(state["model"])  # the adapters, not the base
    assert len(model_keys) == 2 * 2 * len(TARGETS) and all(map(lora.is_adapter, model_keys))
    optim_keys = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in state["optim"] if "." in k}
    assert optim_keys == model_keys
    marker = json.loads(next(ckpt.glob("COMPLETE*")).read_text())
    assert marker["lora_base"] == {
        "folder": str(folder.resolve()),
        "sha256": lora.fingerprint(str(folder.resolve())),
    }


def test_resume_is_exact_at_the_same_layout(where, folder, fsdp2):
    """(At another world size: the LoRA cell of tests/test_resume_matrix.py.)"""
    run = _run(where, folder, "resume", "--nproc-per-node", "2", "--ckpt-dir", "resumed",
               "--resume", str(where / "ckpt" / "step-10"))  # fmt: skip
    assert run.step_losses == fsdp2.step_losses[10:]


def test_resume_against_another_base_is_one_line_and_exit_2(where, folder, fsdp2):
    other = where / "other-base"
    shutil.copytree(folder, other, dirs_exist_ok=True)
    file = sorted(other.glob("*.safetensors"))[0]
    tensors = safetensors_torch.load_file(file)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1e-3  # same architecture and shapes, other weights
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    proc = run_cli(["train", "--model", f"hf:{other}", *FIT, "--nproc-per-node", "1",
                    "--resume", str(where / "ckpt" / "step-10")], cwd=where)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "holds LoRA adapters of the base" in errors[0], errors


# ---------------------------------------------------------------------------- bad input
def test_bad_lora_input_is_one_line(folder, monkeypatch):
    model = f"hf:{folder}"
    cases = [
        (dict(lora_targets="q_proj,nope"), r"^--lora-targets nope matches no linear module of the "
         r"model \(its linear modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
         r"down_proj, lm_head\)$"),
        (dict(strategy="model-parallel"), r"^--lora-rank works with .* not model-parallel$"),
        (dict(pp=2), r"^--lora-rank with --tp/--pp: "),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(UsageError, match=message):
            resolve(TrainConfig(model=model, lora_rank=RANK, seq_len=SEQ, **extra), 1)
    for extra, message in [(dict(lora_rank=0), r"^--lora-rank must be >= 1, got 0$"),
                           (dict(lora_alpha=8.0), r"^--lora-alpha needs --lora-rank R$")]:  # fmt: skip
        with pytest.raises(UsageError, match=message):
            validate_basic(TrainConfig(model=model, **extra))
    with pytest.raises(UsageError, match=r"^--lora-rank on model 'gpt' needs --lora-targets"):
        resolve(TrainConfig(model="gpt", lora_rank=RANK), 1)
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails as when not installed
    with pytest.raises(
        UsageError, match=r"needs PEFT, which is not installed \(pip install -e '\.\[hf\]'\)$"
    ):
        resolve(TrainConfig(model=model, lora_rank=RANK, seq_len=SEQ), 2)


def test_bad_lora_input_exits_2_and_writes_nothing(folder, tmp_path):
    proc = run_cli(["train", "--model", f"hf:{folder}", "--lora-rank", "0", "--ckpt-dir", "ckpt",
                    "--metrics-file", "m.jsonl"], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "fsdp2lab: error: --lora-rank must be >= 1, got 0"
    ], proc.stderr
    proc = run_cli(["train", "--model", f"hf:{folder}", *LORA, "--lora-targets", "w1",
                    "--ckpt-dir", "ckpt", "--metrics-file", "m.jsonl"], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "--lora-targets w1 matches no linear module" in proc.stderr
    assert list(tmp_path.iterdir()) == []
