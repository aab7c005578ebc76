"""Distributed checkpoints end to end: real gloo ranks on CPU through the ``fsdp2lab`` CLI.

One reference run (2 ranks, GPT with dropout, a checkpoint every 3 steps, 8 steps an epoch) is
shared: interrupted and resumed runs must reproduce its losses and weights bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import GPT_TINY, Run, assert_close_lists, train
from fsdp2lab import cli
from fsdp2lab.checkpoint import layout
from fsdp2lab.config import TrainConfig
from fsdp2lab.data import loader as data_loader
from fsdp2lab.models import get_spec

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")

GPT_DATA = ["--dataset", "synthetic", "--synthetic-size", "256", "--global-batch-size", "32"]
GPT_DROPOUT = [*GPT_TINY, *GPT_DATA, "--dropout", "0.1", "--progress", "off"]
EVERY_STEP = ["--log-every-steps", "1"]
TWO_RANKS = [*GPT_DROPOUT, *EVERY_STEP, "--nproc-per-node", "2", "--ckpt-every-steps", "3"]


def losses(run: Run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.events("step")}


def same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


def names(root: Path) -> list[str]:
    return [p.name for p in layout.step_folders(root)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Run]:
    """Never stopped: 16 steps over 2 epochs; checkpoints at 3, 6, 8 (epoch end), 9, ..., 16."""
    where = tmp_path_factory.mktemp("reference")
    run = train(
        where, *TWO_RANKS, "--ckpt-dir", "ckpt", "--keep-last", "0", "--save-model", "final.pt",
        name="ref",
    )  # fmt: skip
    return where, run


@pytest.mark.compat
def test_interrupted_save_keeps_the_last_checkpoint_and_resume_is_exact(reference, tmp_path):
    ref_dir, ref = reference
    want = losses(ref)
    assert sorted(want) == list(range(1, 17))
    keep = ["--ckpt-dir", "ckpt", "--keep-last", "3"]

    # Rank 1 dies while writing its shards of step 12 (mid-epoch 2).
    crashed = train(
        tmp_path,
        *TWO_RANKS,
        *keep,
        name="crashed",
        env={"FSDP2LAB_CKPT_CRASH_AT": "1:12"},
        check=False,
    )
    assert crashed.returncode != 0 and "dying mid-save" in crashed.stdout
    root = tmp_path / "ckpt"
    assert names(root) == ["step-6", "step-8", "step-9", "step-12"]  # 3 was pruned by keep-last
    assert [p.name for p in layout.complete_folders(root)] == ["step-6", "step-8", "step-9"]
    assert any((root / "step-12").glob("*.distcp")) and not (root / "step-12/.metadata").exists()
    assert layout.read_latest(root) == "step-9"
    assert layout.open_checkpoint(root / "step-9").marker["epoch_samples"] == 32
    assert losses(crashed) == {s: want[s] for s in range(1, 13)}  # saving changes nothing

    # --resume auto (the default) falls back to step 9; async saves from there on.
    resumed = train(
        tmp_path, *TWO_RANKS, *keep, "--async-checkpoint", "--save-model", "final.pt", name="r"
    )
    assert f"skipping incomplete checkpoint {Path('ckpt/step-12')}" in resumed.stdout
    assert "resumed from ckpt/step-9: step 9, epoch 2 (32 samples into it)" in resumed.stdout
    assert losses(resumed) == {s: want[s] for s in range(10, 17)}  # bitwise, dropout on
    assert same_weights(tmp_path / "final.pt", ref_dir / "final.pt")
    assert names(root) == ["step-12", "step-15", "step-16"]
    assert layout.read_latest(root) == "step-16"
    assert all(layout.is_complete(root / n) for n in names(root))


def test_resume_at_an_epoch_boundary_is_exact(reference, tmp_path):
    ref_dir, ref = reference
    boundary = ref_dir / "ckpt" / "step-8"
    marker = layout.open_checkpoint(boundary).marker
    assert (marker["epoch"], marker["epoch_samples"], marker["samples_seen"]) == (2, 0, 256)
    run = train(
        tmp_path,
        *GPT_DROPOUT,
        *EVERY_STEP,
        "--nproc-per-node",
        "2",
        "--resume",
        str(boundary),
        "--save-model",
        "final.pt",
    )
    want = losses(ref)
    assert losses(run) == {s: want[s] for s in range(9, 17)}
    assert same_weights(tmp_path / "final.pt", ref_dir / "final.pt")


@pytest.mark.compat
def test_export_info_import_and_pytorch_tools(reference, tmp_path, capsys):
    ref_dir, ref = reference
    exported = tmp_path / "exported.pt"
    assert cli.main(["ckpt", "export", str(ref_dir / "ckpt"), str(exported)]) == 0
    assert same_weights(exported, ref_dir / "final.pt")  # what --save-model writes

    # The exported weights, in the plain model, score what the live model scored.
    cfg = TrainConfig(
        model="gpt", n_layers=2, d_model=32, n_heads=4, seq_len=16, synthetic_size=256
    )
    spec = get_spec("gpt")
    choice = data_loader.DataChoice("synthetic", None, "")
    _, test_set = data_loader.load(choice, cfg, spec)
    model = spec.build(cfg).eval()
    model.load_state_dict(torch.load(exported, weights_only=True))
    x, y = test_set.__getitems__(list(range(len(test_set))))
    with torch.no_grad():
        out = model(x)
    correct = int((out.argmax(-1) == y).sum())
    assert correct / y.numel() == ref.summary["final_test_accuracy"]
    loss = float(torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
    assert loss == pytest.approx(ref.summary["final_test_loss"], abs=1e-5)

    # PyTorch's own tools read the checkpoint.
    flat = tmp_path / "all.pt"
    dcp_to_torch_save(ref_dir / "ckpt" / "step-16", flat)
    everything = torch.load(flat, weights_only=False)
    assert sorted(everything) == ["model", "optim", "ranks", "run", "scheduler", "train_state"]
    assert everything["train_state"] == {
        "epoch": 3,
        "step": 16,
        "samples_seen": 512,
        "epoch_samples": 0,
    }
    plain = torch.load(exported, weights_only=True)
    assert all(torch.equal(everything["model"][k], plain[k]) for k in plain)
    assert sorted(everything["ranks"]) == ["0", "1"]  # each rank wrote its own RNG states
    assert json.loads(everything["run"])["world_size"] == 2

    capsys.readouterr()
    assert cli.main(["ckpt", "info", str(ref_dir / "ckpt")]) == 0
    info = capsys.readouterr().out
    tensors = [v for v in _tensors(everything) if v.dtype != torch.uint8]  # model + optimizer state
    rng = [v for v in _tensors(everything) if v.dtype == torch.uint8]
    total = sum(t.numel() * t.element_size() for t in tensors + rng)
    for line in (
        "step: 16",
        "epoch: 3 (0 samples into it; 512 samples seen)",
        "world size: 2",
        "mesh: dp_shard=2",
        "strategy: fsdp2",
        "model: gpt",
        f"tensors: {len(tensors) + len(rng)}, {total:,} bytes in all",
        "  model.tok_emb.weight  [256, 32]  float32  32,768 bytes",
    ):
        assert line in info

    # Import the plain file and fine-tune from it (lr 0: the weights stay as imported).
    assert cli.main(["ckpt", "import", str(exported), str(tmp_path / "tune")]) == 0
    tuned = train(
        tmp_path,
        *GPT_DROPOUT,
        "--strategy",
        "single",
        "--ckpt-dir",
        "tune",
        "--max-steps",
        "1",
        "--lr",
        "0",
        name="tune",
    )
    assert "loaded model weights from tune/step-0" in tuned.stdout
    assert tuned.summary["final_test_accuracy"] == ref.summary["final_test_accuracy"]
    assert names(tmp_path / "tune") == ["step-0", "step-1"]


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_a_bad_checkpoint_stops_every_rank_with_one_message(reference, tmp_path):
    ref_dir, _ = reference
    ckpt = ref_dir / "ckpt"
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.rglob("*")}
    # The same folder, but a narrower model: the shapes differ.
    narrow = list(TWO_RANKS)
    narrow[narrow.index("--d-model") + 1] = "16"
    run = train(tmp_path, *narrow, "--ckpt-dir", str(ckpt), check=False)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("fsdp2lab: error:") == 1 and "Traceback" not in run.stderr
    assert f"checkpoint {ckpt / 'step-16'} does not fit this run" in run.stderr
    assert "shapes differ" in run.stderr
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.rglob("*")} == before


@pytest.mark.compat
@pytest.mark.slow  # four launches; tests/test_resume_matrix.py checks more of it, more strictly
def test_resume_at_other_world_sizes_meshes_and_strategies(tmp_path):
    """FSDP2 on 4 ranks -> FSDP2 on 2 -> one process, and 4 -> HSDP 2x2 (dropout 0), through
    the CLI, with what it says about the saved layout and the dropout RNG."""
    mlp = ["--model", "mlp", "--dataset", "synthetic", "--synthetic-size", "1024"]
    common = [*mlp, "--dropout", "0", "--progress", "off", *EVERY_STEP, "--max-steps", "12"]
    common += ["--global-batch-size", "64"]
    four = train(
        tmp_path,
        *common,
        "--nproc-per-node",
        "4",
        "--ckpt-dir",
        "four",
        "--ckpt-every-steps",
        "4",
        name="four",
    )
    want = losses(four)
    two = train(
        tmp_path,
        *common,
        "--nproc-per-node",
        "2",
        "--resume",
        "four/step-4",
        "--ckpt-dir",
        "two",
        "--ckpt-every-steps",
        "4",
        name="two",
    )
    assert "saved by fsdp2 on 4 rank(s), mesh dp_shard=4" in two.stdout
    assert "do not map onto 2: each rank's dropout RNG is reseeded" in two.stdout
    one = train(tmp_path, *common, "--strategy", "single", "--resume", "two/step-8", name="one")
    assert "saved by fsdp2 on 2 rank(s), mesh dp_shard=2" in one.stdout
    hsdp = train(
        tmp_path,
        *common,
        "--nproc-per-node",
        "4",
        "--dp-replicate",
        "2",
        "--resume",
        "four/step-8",
        name="hsdp",
    )
    assert "mesh dp_replicate=2 x dp_shard=2" in hsdp.stdout
    for run, first in ((two, 5), (one, 9), (hsdp, 9)):
        got = losses(run)
        assert sorted(got) == list(range(first, 13))
        assert_close_lists([got[s] for s in got], [want[s] for s in got], 1e-5)
        assert run.summary["final_test_accuracy"] == pytest.approx(
            four.summary["final_test_accuracy"], abs=1e-3
        )
