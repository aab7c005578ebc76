"""Checkpoint logic in this process: the folder layout, bad input, async saves, fit checks."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fsdp2lab import cli
from fsdp2lab.checkpoint import layout
from fsdp2lab.checkpoint import state as ckpt_state
from fsdp2lab.checkpoint.export import full_state_dict, read_model_weights
from fsdp2lab.config import TrainConfig, validate_basic
from fsdp2lab.errors import UsageError
from fsdp2lab.training.checkpointing import CheckpointManager, choose_resume
from fsdp2lab.training.trainer import Trainer

# dcp.save/load in this process without a process group warn that they assume one process.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


def _save_plain(path: Path, step: int, scale: float = 1.0) -> Path:
    """A small complete checkpoint written in this process, as the trainer writes one."""
    layout.mark_own(path)
    state = {
        "model": {"w": torch.arange(12.0).reshape(3, 4) * scale, "b": torch.ones(3)},
        "train_state": {"step": step},
    }
    dcp.save(state, checkpoint_id=path, no_dist=True)
    layout.mark_complete(path, {"step": step, "contents": ["model"]})
    return path


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    for step in (2, 4, 6):
        _save_plain(layout.step_dir(root, step), step, scale=step)
    layout.set_latest(root, layout.step_dir(root, 6))
    return root


def _info_error(path: Path, capsys) -> str:
    assert cli.main(["ckpt", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("fsdp2lab: error:") == 1 and "Traceback" not in err
    return err


# ---------------------------------------------------------------------------- layout
def test_complete_mark_records_every_file_and_latest_moves_atomically(ckpt_dir: Path):
    step6 = ckpt_dir / "step-6"
    marker = json.loads((step6 / layout.COMPLETE).read_text())
    on_disk = {p.name: p.stat().st_size for p in step6.iterdir() if p.name != layout.COMPLETE}
    assert marker["files"] == on_disk and ".metadata" in on_disk
    assert any(name.endswith(".distcp") for name in on_disk)
    assert layout.read_latest(ckpt_dir) == "step-6"
    assert not list(ckpt_dir.glob(".*tmp*")) and not list(step6.glob(".*tmp*"))


def test_keep_last_removes_only_older_checkpoints_once_a_newer_is_complete(ckpt_dir: Path):
    unfinished_old = ckpt_dir / "step-3"
    layout.mark_own(unfinished_old)
    unfinished_new = ckpt_dir / "step-8"  # a save in progress (or dead) after the newest
    layout.mark_own(unfinished_new)
    (ckpt_dir / "step-1").mkdir()  # another tool's (no .fsdp2lab-save mark): never deleted
    removed = layout.prune(ckpt_dir, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-2", "step-3"]
    folders = ["step-1", "step-4", "step-6", "step-8"]
    assert [p.name for p in layout.step_folders(ckpt_dir)] == folders
    assert layout.prune(ckpt_dir, keep_last=2) == []
    assert layout.remove_unfinished(ckpt_dir) == [unfinished_new]
    assert [p.name for p in layout.complete_folders(ckpt_dir)] == ["step-4", "step-6"]
    assert (ckpt_dir / "step-1").is_dir()


def test_resume_auto_skips_an_incomplete_newest_checkpoint_and_says_so(ckpt_dir: Path):
    shutil.copytree(ckpt_dir / "step-6", ckpt_dir / "step-9")
    (ckpt_dir / "step-9" / layout.COMPLETE).unlink()
    notes: list[str] = []
    cfg = TrainConfig(ckpt_dir=str(ckpt_dir))
    ckpt = choose_resume(cfg, notes)
    assert ckpt.path == ckpt_dir / "step-6" and ckpt.step == 6
    assert notes == [
        f"skipping incomplete checkpoint {ckpt_dir / 'step-9'} (no COMPLETE mark: its save did "
        "not finish)"
    ]
    assert choose_resume(TrainConfig(ckpt_dir=str(ckpt_dir / "fresh")), []) is None


def test_resume_choices_that_would_overwrite_checkpoints_are_refused(ckpt_dir: Path):
    with pytest.raises(UsageError, match=r"already holds checkpoints up to step-6.*fresh start"):
        choose_resume(TrainConfig(ckpt_dir=str(ckpt_dir), resume="never"), [])
    older = str(ckpt_dir / "step-2")
    with pytest.raises(UsageError, match=r"up to step-6, newer than .*\(step 2\)"):
        choose_resume(TrainConfig(ckpt_dir=str(ckpt_dir), resume=older), [])
    # Resuming from elsewhere into an empty directory is fine.
    ckpt = choose_resume(TrainConfig(ckpt_dir=str(ckpt_dir.parent / "new"), resume=older), [])
    assert ckpt.step == 2


def test_checkpoint_flags_need_a_directory():
    validate_basic(TrainConfig(keep_last=2))  # the default applies only with --ckpt-dir
    with pytest.raises(UsageError, match="--ckpt-every-steps must be >= 1, got 0"):
        validate_basic(TrainConfig(ckpt_dir="x", ckpt_every_steps=0))
    with pytest.raises(UsageError, match="--async-checkpoint needs --ckpt-dir DIR"):
        validate_basic(TrainConfig(async_checkpoint=True))


# ---------------------------------------------------------------------------- bad input
def test_bad_checkpoints_give_one_clear_error_naming_the_path(ckpt_dir: Path, capsys):
    missing = ckpt_dir / "step-99"
    assert f"checkpoint not found: {missing}" in _info_error(missing, capsys)

    unmarked = ckpt_dir / "step-4"
    (unmarked / layout.COMPLETE).rename(ckpt_dir / "saved-mark")
    err = _info_error(unmarked, capsys)
    assert f"checkpoint {unmarked} is incomplete: it has no COMPLETE mark" in err
    (ckpt_dir / "saved-mark").rename(unmarked / layout.COMPLETE)

    step6 = ckpt_dir / "step-6"
    shard = next(step6.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    err = _info_error(step6, capsys)
    assert f"shard file {shard} is truncated or damaged ({len(data) // 2} bytes," in err
    shard.unlink()
    assert f"shard file {shard} is missing" in _info_error(step6, capsys)
    shard.write_bytes(data)

    (step6 / ".metadata").rename(ckpt_dir / "saved-metadata")
    err = _info_error(step6, capsys)
    assert f"checkpoint {step6} has no .metadata file" in err
    # The directory form resolves to the newest complete one, and reports the same problem.
    assert f"checkpoint {step6} has no .metadata file" in _info_error(ckpt_dir, capsys)
    (ckpt_dir / "saved-metadata").rename(step6 / ".metadata")

    assert cli.main(["ckpt", "info", str(ckpt_dir)]) == 0
    assert f"checkpoint: {step6}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a pickle", "cannot be read (invalid load key"),
        (pickle.dumps({"state_dict_metadata": {}}), "is not DCP metadata"),
    ],
)
def test_a_damaged_metadata_file_is_one_clear_error(ckpt_dir: Path, capsys, content, message):
    step6 = ckpt_dir / "step-6"
    (step6 / layout.METADATA).write_bytes(content)
    (step6 / layout.COMPLETE).unlink()
    layout.mark_complete(step6, {"step": 6, "contents": ["model"]})  # sizes as they are now
    assert f"checkpoint {step6}: .metadata {message}" in _info_error(step6, capsys)


def test_export_import_round_trip_and_refusals(ckpt_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "model.pt"
    assert cli.main(["ckpt", "export", str(ckpt_dir), str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["w"], torch.arange(12.0).reshape(3, 4) * 6)
    assert torch.equal(exported["b"], torch.ones(3))

    new_root = tmp_path / "imported"
    assert cli.main(["ckpt", "import", str(out), str(new_root)]) == 0
    ckpt = layout.find_checkpoint(new_root, [])
    assert ckpt.path == new_root / "step-0" and layout.read_latest(new_root) == "step-0"
    back = read_model_weights(ckpt)
    assert back.keys() == exported.keys()
    assert all(torch.equal(back[k], exported[k]) for k in back)
    capsys.readouterr()

    assert cli.main(["ckpt", "import", str(out), str(new_root)]) == 2
    assert f"{new_root} already holds checkpoints" in capsys.readouterr().err
    torch.save({"not": "tensors"}, tmp_path / "junk.pt")
    assert cli.main(["ckpt", "import", str(tmp_path / "junk.pt"), str(tmp_path / "x")]) == 2
    assert "is not a state dict" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_flatten_names_entries_as_dcp_does(tmp_path: Path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"optim": optimizer.state_dict(), "sched": {"base_lrs": [0.1], "last_epoch": 3}}
    dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    saved = dcp.FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata
    assert set(ckpt_state.flatten(state)) == set(saved)


# ---------------------------------------------------------------------------- with a trainer
def _cfg(tmp_path: Path, **overrides) -> TrainConfig:
    values = dict(
        model="mlp",
        dataset="synthetic",
        synthetic_size=256,
        global_batch_size=32,
        progress="off",
        ckpt_dir=str(tmp_path / "ckpt"),
    )
    values.update(overrides)
    return TrainConfig(**values)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_copy(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full weights, copied (on one CPU rank the gathered tensors alias the parameters)."""
    return {k: v.clone() for k, v in full_state_dict(trainer.model).items()}


def test_async_save_holds_the_state_of_the_step_it_was_asked_for(one_rank, tmp_path: Path):
    cfg = _cfg(tmp_path, async_checkpoint=True)
    trainer = Trainer(cfg, one_rank)
    manager = CheckpointManager(cfg, one_rank)
    trainer.state.step = 3
    before = _full_copy(trainer)
    manager.save(trainer)
    first = manager.in_flight
    assert first is not None  # handed to the background writer
    with torch.no_grad():  # training goes on and changes the parameters at once
        for p in trainer.model.parameters():
            p.add_(1.0)
    after = _full_copy(trainer)
    trainer.state.step = 4
    manager.save(trainer)  # at most one save in flight: step 3 is finished and marked first
    assert first.future.done() and layout.is_complete(layout.step_dir(cfg.ckpt_dir, 3))
    manager.close()
    root = Path(cfg.ckpt_dir)
    saved3 = read_model_weights(layout.open_checkpoint(root / "step-3"))
    saved4 = read_model_weights(layout.open_checkpoint(root / "step-4"))
    assert saved3.keys() == before.keys() and len(before) == 6
    for key in before:
        assert torch.equal(saved3[key], before[key]), key
        assert torch.equal(saved4[key], after[key]), key
        assert not torch.equal(before[key], after[key])
    assert layout.read_latest(root) == "step-4"


def test_resume_restores_weights_optimizer_schedule_and_position(one_rank, tmp_path: Path):
    cfg = _cfg(tmp_path, optimizer="adam")
    trainer = Trainer(cfg, one_rank)
    trainer.optimizer.zero_grad()
    sum(p.sum() for p in trainer.model.parameters()).backward()
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.state.step, trainer.state.epoch_samples, trainer.state.samples_seen = 5, 160, 160
    CheckpointManager(cfg, one_rank).save(trainer)

    fresh = Trainer(cfg, one_rank)
    CheckpointManager(cfg, one_rank).before_fit(fresh)
    assert fresh.state == trainer.state
    assert fresh.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.7e-3)
    saved, loaded = _full_copy(trainer), _full_copy(fresh)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    old_opt, new_opt = trainer.optimizer.state_dict(), fresh.optimizer.state_dict()
    for key, value in old_opt["state"][0].items():
        assert torch.equal(_full(new_opt["state"][0][key]), _full(value)), key


def test_a_checkpoint_of_another_model_is_refused(one_rank, tmp_path: Path):
    saved_cfg = _cfg(tmp_path, model="gpt", n_layers=2, d_model=32, n_heads=4, seq_len=16)
    trainer = Trainer(saved_cfg, one_rank)
    trainer.state.step = 1
    CheckpointManager(saved_cfg, one_rank).save(trainer)
    path = Path(saved_cfg.ckpt_dir) / "step-1"
    before = {p: p.stat().st_mtime_ns for p in path.parent.rglob("*")}

    narrower = _cfg(tmp_path, model="gpt", n_layers=2, d_model=16, n_heads=4, seq_len=16)
    with pytest.raises(UsageError) as shapes:
        CheckpointManager(narrower, one_rank).before_fit(Trainer(narrower, one_rank))
    assert f"checkpoint {path} does not fit this run" in str(shapes.value)
    assert "shapes differ (model.blocks.0.attn.wk.weight: [32, 32] in the checkpoint, [16, 16]" in (
        str(shapes.value)
    )
    mlp = _cfg(tmp_path, model="mlp")
    with pytest.raises(UsageError) as keys:
        CheckpointManager(mlp, one_rank).before_fit(Trainer(mlp, one_rank))
    message = str(keys.value)
    assert "it was saved with --model gpt, this run uses --model mlp" in message
    assert "entries of this run are not in it (model.fc.0.bias" in message
    assert "of its tensors are not in this model" in message
    assert {p: p.stat().st_mtime_ns for p in path.parent.rglob("*")} == before


def test_loader_position_reads_a_real_loader_state(one_rank, tmp_path: Path):
    trainer = Trainer(_cfg(tmp_path), one_rank)
    trainer.sampler.set_epoch(2, 64)
    batches = iter(trainer.loader)
    next(batches), next(batches)
    saved = ckpt_state._rank_state(trainer)
    assert isinstance(saved["loader"], str)  # JSON text, plain data
    assert json.loads(saved["loader"]) == trainer.loader.state_dict()
    assert ckpt_state.loader_position(saved, trainer.sampler.micro_global) == (2, 128)
    # A loader state of the earlier (pickled) format is never unpickled: its check is skipped.
    old = {"loader": pickle.dumps(trainer.loader.state_dict())}
    assert ckpt_state.loader_position(old, trainer.sampler.micro_global) is None
