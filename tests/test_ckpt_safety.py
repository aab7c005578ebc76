"""A checkpoint is data: opening one runs no code. One run per --ckpt-dir; only this tool's
folders are deleted; export is atomic and never replaces what it reads.

Booby-trapped files are pickles that would ``touch`` a sentinel file; the sentinel must never
appear, and every refusal is one line with exit code 2.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unsafe_loads
from conftest import TINY, run_cli
from fsdp2lab import cli
from fsdp2lab.checkpoint import layout
from fsdp2lab.checkpoint import safetensors_export as st_export
from fsdp2lab.checkpoint import state as ckpt_state
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.runtime.torch_compat import RefusedPickle, SafeFileSystemReader, SafeLoadPlanner
from fsdp2lab.training.checkpointing import CheckpointManager, choose_resume
from fsdp2lab.training.trainer import Trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


class Trap:
    """Unpickling this runs ``touch SENTINEL``."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


@pytest.fixture
def sentinel(tmp_path: Path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "a checkpoint file ran code"


def _save_plain(path: Path, step: int = 2, extra: dict | None = None) -> Path:
    layout.mark_own(path)
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": step}}
    dcp.save({**state, **(extra or {})}, checkpoint_id=path, no_dist=True)
    layout.mark_complete(path, {"step": step, "contents": ["model"]})
    return path


def _remark(path: Path, **info) -> None:
    """Mark ``path`` complete again with its files' sizes as they are now."""
    (path / layout.COMPLETE).unlink()
    layout.mark_complete(path, {"step": 2, "contents": ["model"], **info})


def _one_error(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp2lab: error:") and err.count("\n") == 1, err  # one line
    return err


# ---------------------------------------------------------------------------- no code runs
def test_a_booby_trapped_metadata_is_refused_by_info_export_and_resume(
    tmp_path: Path, sentinel: Path, capsys
):
    step = _save_plain(tmp_path / "ckpt" / "step-2")
    (step / layout.METADATA).write_bytes(pickle.dumps(Trap(sentinel)))
    _remark(step)
    want = f"checkpoint {step}: .metadata is not DCP metadata (it names posix.system): refused"
    assert want in _one_error(["ckpt", "info", str(step)], capsys)
    for out in ("m.pt", "m.safetensors", "folder"):
        assert want in _one_error(["ckpt", "export", str(step), str(tmp_path / out)], capsys)
        assert not (tmp_path / out).exists()
    with pytest.raises(UsageError, match="it names posix.system"):  # train: rank 0's choice
        choose_resume(TrainConfig(ckpt_dir=str(tmp_path / "ckpt")), [])


def test_import_of_a_booby_trapped_file_is_refused(tmp_path: Path, sentinel: Path, capsys):
    torch.save({"w": Trap(sentinel)}, tmp_path / "trap.pt")
    err = _one_error(["ckpt", "import", str(tmp_path / "trap.pt"), str(tmp_path / "c")], capsys)
    assert "trap.pt cannot be read as a torch.save file (a value in it is refused (it names " in err
    assert not (tmp_path / "c").exists()


def _trainer_cfg(tmp_path: Path) -> TrainConfig:
    return TrainConfig(
        model="mlp",
        dataset="synthetic",
        synthetic_size=256,
        global_batch_size=32,
        progress="off",
        ckpt_dir=str(tmp_path / "ckpt"),
    )


def _save_with_loader(trainer: Trainer, path: Path, loader) -> None:
    """A checkpoint of ``trainer`` whose data loader state is ``loader``."""
    layout.mark_own(path)
    state = ckpt_state.capture(trainer)
    state[ckpt_state.RANKS]["0"]["loader"] = loader
    dcp.save(state, checkpoint_id=path)
    layout.mark_complete(path, ckpt_state.marker_info(trainer))


def test_a_booby_trapped_loader_state_is_refused_on_resume(one_rank, tmp_path, sentinel):
    cfg = _trainer_cfg(tmp_path)
    trainer = Trainer(cfg, one_rank)
    trainer.state.step = 3
    path = layout.step_dir(cfg.ckpt_dir, 3)
    _save_with_loader(trainer, path, Trap(sentinel))  # DCP stores it with torch.save
    with pytest.raises(
        UsageError,
        match=rf"checkpoint {path} could not be read: a value in it is refused \(it names posix.system\): it is read",
    ):
        CheckpointManager(cfg, one_rank).before_fit(Trainer(cfg, one_rank))

    # A loader state of the earlier format (pickled bytes) is kept as bytes, never unpickled.
    layout.remove(path)
    _save_with_loader(trainer, path, pickle.dumps(Trap(sentinel)))
    fresh = Trainer(cfg, one_rank)
    CheckpointManager(cfg, one_rank).before_fit(fresh)
    assert fresh.state.step == 3


@pytest.mark.compat
def test_the_restricted_reader_reads_what_dcp_writes(tmp_path: Path):
    state = {
        "model": {"w": torch.ones(3, 2, dtype=torch.bfloat16), "n": torch.arange(4)},
        "values": {"s": "text", "f": 0.5, "t": (1, 2.0), "none": None, "l": [1, "a"]},
        "raw": b"bytes",
    }
    dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    ours = SafeFileSystemReader(tmp_path / "c").read_metadata()
    theirs = dcp.FileSystemReader(tmp_path / "c").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    back = {
        "model": {"w": torch.zeros(3, 2, dtype=torch.bfloat16), "n": torch.zeros(4, dtype=int)},
        "values": {k: None for k in state["values"]},
        "raw": None,
    }
    dcp.load(
        back,
        storage_reader=SafeFileSystemReader(tmp_path / "c"),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["values"] == state["values"] and back["raw"] == b"bytes"


# ---------------------------------------------------------------------------- the folder
def test_a_second_run_on_a_checkpoint_folder_is_refused(tmp_path: Path):
    root = tmp_path / "ckpt"
    step = _save_plain(root / "step-2")
    held = layout.lock(root)  # the first run
    try:
        before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
        args = ["train", *TINY, "--nproc-per-node", "1", "--max-steps", "2", "--ckpt-dir"]
        proc = run_cli([*args, str(root), "--resume", str(step)], cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert errors == [
            f"fsdp2lab: error: --ckpt-dir {root} is in use by another run (it holds "
            f"{root}/.lock; `fuser {root}/.lock` names it on its host); wait for it to end or "
            "use another --ckpt-dir"
        ], proc.stderr[-3000:]
        assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before
    finally:
        held.close()


def test_the_lock_is_held_for_the_run_and_released_at_its_end(one_rank, tmp_path: Path):
    cfg = _trainer_cfg(tmp_path)
    first = CheckpointManager(cfg, one_rank)
    with pytest.raises(UsageError, match="is in use by another run"):
        CheckpointManager(cfg, one_rank)
    first.close()
    CheckpointManager(cfg, one_rank).close()


def test_only_this_tools_unfinished_saves_are_deleted(tmp_path: Path):
    root = tmp_path / "ckpt"
    _save_plain(root / "step-2")
    foreign = root / "step-4"  # another tool's (torchtitan names its saves step-N), in progress
    foreign.mkdir()
    (foreign / "shard").write_bytes(b"x")
    ours = root / "step-6"
    layout.mark_own(ours)  # a save of ours that died
    assert layout.remove_unfinished(root) == [ours]
    assert layout.prune(root, keep_last=1) == []
    assert (foreign / "shard").read_bytes() == b"x"
    layout.remove(foreign)  # asked directly, still not
    assert foreign.is_dir()


def test_a_save_never_writes_into_another_tools_step_folder(one_rank, tmp_path, caplog):
    cfg = _trainer_cfg(tmp_path)
    trainer = Trainer(cfg, one_rank)
    trainer.state.step = 4
    foreign = layout.step_dir(cfg.ckpt_dir, 4)
    foreign.mkdir(parents=True)
    (foreign / "shard").write_bytes(b"x")
    manager = CheckpointManager(cfg, one_rank)
    manager.save(trainer)
    manager.close()
    assert [p.name for p in foreign.iterdir()] == ["shard"]
    assert f"checkpoint {foreign} not saved: that folder is not fsdp2lab's" in caplog.text


def test_a_failed_latest_write_warns_and_deletes_nothing(one_rank, tmp_path, monkeypatch, caplog):
    cfg = _trainer_cfg(tmp_path)
    trainer = Trainer(cfg, one_rank)
    trainer.state.step = 2
    manager = CheckpointManager(cfg, one_rank)

    def fail(root, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout, "set_latest", fail)
    manager.save(trainer)
    manager.close()  # no TrainingFailed: the checkpoint is complete
    path = layout.step_dir(cfg.ckpt_dir, 2)
    assert layout.is_complete(path) and layout.open_checkpoint(path).step == 2
    assert f"{path} is complete, but {path.parent / 'latest'} was not updated" in caplog.text


def test_info_of_a_damaged_mark_is_one_line(tmp_path: Path, capsys):
    step = _save_plain(tmp_path / "step-2")
    _remark(step, mesh="dp=2")
    err = _one_error(["ckpt", "info", str(step)], capsys)
    assert f"checkpoint {step}: its COMPLETE mark is damaged (TypeError" in err


# ---------------------------------------------------------------------------- export
def test_export_to_a_folder_is_atomic(tmp_path: Path, monkeypatch):
    step = _save_plain(
        tmp_path / "step-2", extra={"model": {"a": torch.ones(40), "b": torch.ones(40)}}
    )
    out = tmp_path / "out"
    st_export.export_safetensors(step, out, max_shard_size=200)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(first) == 4  # two shards, their index and fsdp2lab's mark
    real = st_export.hf_consolidate

    def dies_half_way(shards, out, fqn_to_index):  # the first file written, then an I/O error
        real(shards, out, {k: v for k, v in fqn_to_index.items() if v == 1})
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(st_export, "hf_consolidate", dies_half_way)
    with pytest.raises(OSError):
        st_export.export_safetensors(step, out, max_shard_size=100)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # the earlier export, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_export_never_replaces_what_it_reads(tmp_path: Path, capsys):
    model_dir = tmp_path / "pretrained"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    step = _save_plain(tmp_path / "ckpt" / "step-2")
    _remark(step, hf_source=str(model_dir))
    for out, why in (
        (model_dir, "the model folder the run started from"),
        (step, "the checkpoint"),
        (tmp_path / "ckpt", "the checkpoint's folder"),
    ):
        err = _one_error(["ckpt", "export", str(step), str(out), "--format", "safetensors"], capsys)
        assert f"export to {out} refused: it is {why}" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    err = _one_error(["ckpt", "export", str(step), str(tmp_path / "mine")], capsys)
    assert "fsdp2lab did not write that folder (it has no .fsdp2lab-export mark)" in err
    assert (model_dir / "tokenizer.json").read_text() == "{}"


def test_companion_files_come_only_from_the_recorded_folder_unchanged(tmp_path: Path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"v": 1}')
    (folder / "evil.py").write_text("x")
    recorded = ckpt_state.companion_files(None, str(folder))
    assert set(recorded) == {"tokenizer.json"}
    run = {"companions": recorded}
    assert st_export.companion_sources(run) == [
        (folder.resolve() / "tokenizer.json", "tokenizer.json")
    ]
    # A mark naming other files or folders copies nothing it did not record.
    assert st_export.companion_sources({"companions": {"evil.py": {"folder": str(folder)}}}) == []
    (folder / "tokenizer.json").write_text('{"v": 2}')
    with pytest.raises(UsageError, match="tokenizer.json changed since the run"):
        st_export.companion_sources(run)


def test_nothing_outside_the_restricted_reader_unpickles():
    """The AST check (tests/unsafe_loads.py) finds no unsafe load in src, and what it exempts
    by name is what torch_compat defines."""
    from fsdp2lab.runtime import torch_compat

    src = Path(__file__).parents[1] / "src"
    assert unsafe_loads.check_tree(src) == []
    for name in (
        unsafe_loads.RESTRICTED_UNPICKLER,
        unsafe_loads.SAFE_READER,
        unsafe_loads.SAFE_PLANNER,
    ):
        exempt = getattr(torch_compat, name.rpartition(".")[2])
        assert f"{exempt.__module__}.{exempt.__qualname__}" == name


_SAFE_DCP = "from fsdp2lab.runtime.torch_compat import SafeFileSystemReader, SafeLoadPlanner\n"
_UNSAFE_LOADS = {
    # the variants a grep missed
    "from-import": "from pickle import loads\nloads(b)",
    "from-import-as": "from pickle import loads as l\nl(b)",
    "module-alias": "import pickle as pk\npk.loads(b)",
    "weights-only-0": "import torch\ntorch.load(p, weights_only=0)",
    "dcp-from-import": "from torch.distributed.checkpoint import load\nload(s, checkpoint_id=p)",
    "dcp-package-alias": "from torch.distributed import checkpoint as dcp\ndcp.load(s, checkpoint_id=p)",
    "state-dict-loader": "import torch.distributed.checkpoint as dcp\n"
    "dcp.state_dict_loader.load(s, checkpoint_id=p)",
    "dcp-to-torch-save": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(p, q)",
    "torch-save-to-dcp": "import torch.distributed.checkpoint.format_utils as fu\nfu.torch_save_to_dcp(p, q)",
    "torch-jit": "import torch\ntorch.jit.load(p)",
    "dill": "import dill\ndill.load(f)",
    # torch.load without weights_only=True; numpy's allow_pickle
    "torch-load-bare": "import torch\ntorch.load(p)",
    "weights-only-false": "import torch\ntorch.load(p, weights_only=False)",
    "weights-only-variable": "import torch\ntorch.load(p, weights_only=flag)",
    "weights-only-kwargs": "import torch\ntorch.load(p, **options)",
    "torch-serialization": "from torch.serialization import load\nload(p)",
    "allow-pickle": "import numpy as np\nnp.load(p, allow_pickle=True)",
    "allow-pickle-variable": "import numpy as np\nnp.load(p, allow_pickle=flag)",
    "allow-pickle-positional": "import numpy as np\nnp.load(p, None, True)",
    # unpicklers
    "pickle-load": "import pickle\npickle.load(f)",
    "_pickle": "import _pickle\n_pickle.loads(b)",
    "unpickler": "import pickle\npickle.Unpickler(f).load()",
    "unpickler-subclass": "import pickle\nclass Mine(pickle.Unpickler):\n    pass",
    "private-unpickler": "from pickle import _Unpickler\n_Unpickler(f).load()",
    "restricted-subclass": "from fsdp2lab.runtime.torch_compat import _MetadataUnpickler\n"
    "class Open(_MetadataUnpickler):\n    def find_class(self, m, n):\n        return n",
    # other libraries that unpickle or load code
    "cloudpickle": "import cloudpickle\ncloudpickle.loads(b)",
    "joblib": "from joblib import load\nload(p)",
    "shelve": "import shelve\nshelve.open(p)",
    "marshal-loads": "import marshal\nmarshal.loads(b)",
    "marshal-load": "from marshal import load\nload(f)",
    "torch-package": "from torch.package import PackageImporter\nPackageImporter(p)",
    "torch-hub": "import torch.hub\ntorch.hub.load(repo, m)",
    # DCP with a reader or planner that unpickles
    "plain-reader": "import torch.distributed.checkpoint as dcp\ndcp.FileSystemReader(p)",
    "plain-reader-imported": "from torch.distributed.checkpoint import FileSystemReader\n"
    "FileSystemReader(p)",
    "reader-subclass": "from torch.distributed.checkpoint.filesystem import FileSystemReader\n"
    "class R(FileSystemReader):\n    pass",
    "dcp-without-planner": _SAFE_DCP + "import torch.distributed.checkpoint as dcp\n"
    "dcp.load(s, storage_reader=SafeFileSystemReader(p))",
    "dcp-without-reader": _SAFE_DCP + "import torch.distributed.checkpoint as dcp\n"
    "dcp.load(s, checkpoint_id=p, planner=SafeLoadPlanner())",
    "dcp-default-planner": "import torch.distributed.checkpoint as dcp\n"
    "from torch.distributed.checkpoint import DefaultLoadPlanner\n"
    "dcp.load(s, storage_reader=r, planner=DefaultLoadPlanner())",
    "load-state-dict": _SAFE_DCP + "import torch.distributed.checkpoint as dcp\n"
    "dcp.load_state_dict(s, SafeFileSystemReader(p))",
    "super-past-safe-reader": _SAFE_DCP + "class R(SafeFileSystemReader):\n"
    "    def read_metadata(self):\n        return super(SafeFileSystemReader, self).read_metadata()",
    # ways round a name
    "getattr": "import pickle\ngetattr(pickle, 'loads')(b)",
    "import-module": "import importlib\nimportlib.import_module('pickle').loads(b)",
    "dunder-import": "__import__('pickle').loads(b)",
    "handed-on": "import pickle\nread = pickle.loads\nread(b)",
    "module-assigned": "import pickle\npk = pickle\npk.loads(b)",
    "star-import": "from pickle import *\nloads(b)",
}
_SAFE_LOADS = {
    "torch-weights-only": "import torch\ntorch.load(p, map_location='cpu', weights_only=True)",
    "numpy": "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)",
    "restricted-unpickler": "from fsdp2lab.runtime.torch_compat import load_dcp_metadata\n"
    "load_dcp_metadata(f)",
    "json": "import json\njson.loads(s)",
    "safetensors": "from safetensors import safe_open\nfrom safetensors.torch import load_file\n"
    "load_file(p)\nsafe_open(p, framework='pt')",
    "dcp-safe-pair": _SAFE_DCP + "import torch.distributed.checkpoint as dcp\n"
    "dcp.load(s, storage_reader=SafeFileSystemReader(p), planner=SafeLoadPlanner())",
    "safe-reader-subclass": _SAFE_DCP + "from torch.distributed import checkpoint\n"
    "class Once(SafeFileSystemReader):\n    pass\n"
    "checkpoint.load(s, storage_reader=Once(p), planner=SafeLoadPlanner(), no_dist=True)",
    "pickle-without-loading": "import pickle\npickle.dumps(x)\n"
    "isinstance(e, pickle.UnpicklingError)",
    "annotation": "import torch.distributed.checkpoint as dcp\n"
    "def f(reader: dcp.FileSystemReader) -> None:\n    pass",
    "relative-import": "from .runtime.torch_compat import SafeFileSystemReader as R\n"
    "from .runtime import torch_compat as tc\nimport torch.distributed.checkpoint as dcp\n"
    "dcp.load(s, storage_reader=R(p), planner=tc.SafeLoadPlanner())",
    "own-function-named-load": "def load(p):\n    return p\nload(p)",
}


def _check_module(root: Path, source: str) -> list[str]:
    """The unsafe-load check's findings for ``source`` as the module ``fsdp2lab.mod``."""
    (root / "fsdp2lab").mkdir()
    (root / "fsdp2lab" / "mod.py").write_text(source + "\n")
    return unsafe_loads.check_tree(root)


@pytest.mark.parametrize("source", _UNSAFE_LOADS.values(), ids=_UNSAFE_LOADS)
def test_the_unsafe_load_check_catches_each_way_to_unpickle(tmp_path: Path, source: str):
    assert _check_module(tmp_path, source) != [], source


@pytest.mark.parametrize("source", _SAFE_LOADS.values(), ids=_SAFE_LOADS)
def test_the_unsafe_load_check_passes_safe_loads(tmp_path: Path, source: str):
    assert _check_module(tmp_path, source) == []


def _calling(module: str, name: str, *args) -> bytes:
    """A pickle that calls ``module.name(*args)`` when it is loaded."""
    return f"c{module}\n{name}\n".encode() + pickle.dumps(args, protocol=2)[2:-1] + b"R."


def _traps(sentinel: Path) -> dict[str, tuple[bytes, str]]:
    """Each trap: a ``.metadata`` that leaves ``sentinel`` if it is run, and the refusal."""
    code = f"open({str(sentinel)!r}, 'w').close()"
    touch = f"touch {sentinel}"
    getattr_chain = (  # getattr(__import__("os"), "system")("touch SENTINEL")
        b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V"
        + touch.encode()
        + b"\ntR."
    )
    partial = (  # functools.partial(os.system, "touch SENTINEL")()
        b"cfunctools\npartial\n(cos\nsystem\nV" + touch.encode() + b"\ntR)R."
    )
    trap_file = sentinel.parent / "trap.pt"
    torch.save({"w": Trap(sentinel)}, trap_file)
    return {
        "exec": (_calling("builtins", "exec", code), "it names builtins.exec"),
        "eval": (_calling("builtins", "eval", code), "it names builtins.eval"),
        "getattr": (getattr_chain, "it names builtins.getattr"),
        "functools.partial": (partial, "it names functools.partial"),
        "subprocess.Popen": (
            _calling("subprocess", "Popen", ["touch", str(sentinel)]),
            "it names subprocess.Popen",
        ),
        "torch.load": (
            _calling("torch", "load", str(trap_file), None, None, False),
            "it names torch.load",
        ),  # fmt: skip
        "os.system": (_calling("os", "system", touch), "it names os.system"),
        "not-metadata": (pickle.dumps({"state_dict_metadata": {}}), "it holds a dict"),
    }


@pytest.mark.parametrize(
    "trap",
    ["exec", "eval", "getattr", "functools.partial", "subprocess.Popen", "torch.load",
     "os.system", "not-metadata"],
)  # fmt: skip
def test_each_metadata_trap_is_refused(tmp_path: Path, sentinel: Path, trap: str):
    """A DCP ``.metadata`` naming code, or holding something other than DCP ``Metadata``."""
    step = _save_plain(tmp_path / "step-2")
    payload, why = _traps(sentinel)[trap]
    (step / layout.METADATA).write_bytes(payload)
    with pytest.raises(RefusedPickle, match=re.escape(why)):
        SafeFileSystemReader(step).read_metadata()


# ---------------------------------------------------------------------------- the index's claims
def _altered_index(step: Path, change) -> None:
    """``step``'s ``.metadata`` as ``change(metadata)`` leaves it (DCP's own classes, pickled
    here: what a hand-edited checkpoint can claim), its ``COMPLETE`` mark made again."""
    metadata = SafeFileSystemReader(step).read_metadata()
    change(metadata)
    (step / layout.METADATA).write_bytes(pickle.dumps(metadata))
    _remark(step)


def _outside_paths(step: Path) -> dict[str, str]:
    """Storage paths that leave ``step``, each naming a real copy of its shard there."""
    shard = next(step.glob("*.distcp"))
    elsewhere = step.parents[1] / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / shard.name).write_bytes(shard.read_bytes())
    return {
        "dot-dot": f"../../elsewhere/{shard.name}",
        "absolute": str(elsewhere / shard.name),
        "a-folder": f"sub/{shard.name}",
    }


@pytest.mark.parametrize("where", ["dot-dot", "absolute", "a-folder"])
def test_a_storage_path_outside_the_step_folder_is_refused(tmp_path: Path, capsys, where: str):
    """A ``.metadata`` pointing its shard at a file elsewhere (which exists): nothing is read
    outside the step folder, one line, exit code 2 (the export read it before)."""
    step = _save_plain(tmp_path / "ckpt" / "step-2")
    path = _outside_paths(step)[where]
    (step / "sub").mkdir()
    (step / "sub" / Path(path).name).write_bytes(next(step.glob("*.distcp")).read_bytes())

    def point_outside(metadata):
        from dataclasses import replace

        metadata.storage_data = {
            index: replace(info, relative_path=path)
            for index, info in metadata.storage_data.items()
        }

    _altered_index(step, point_outside)
    want = (
        f"checkpoint {step}: .metadata names the shard file {path!r}, which is not a file name in "
        "the checkpoint's folder: refused, nothing is read outside it"
    )
    for out in ("m.pt", "m.safetensors", "folder"):
        assert want in _one_error(["ckpt", "export", str(step), str(tmp_path / out)], capsys)
        assert not (tmp_path / out).exists()
    assert want in _one_error(["ckpt", "info", str(step)], capsys)


def test_a_tensor_bigger_than_its_files_is_refused_before_anything_is_allocated(
    tmp_path: Path, capsys, monkeypatch
):
    """A ``.metadata`` claiming a 10^7 x 10^7 tensor (400 TB) stored in a few bytes: one line,
    exit code 2, and no tensor allocated (the export tried to allocate it before)."""
    step = _save_plain(tmp_path / "step-2")

    def huge(metadata):
        metadata.state_dict_metadata["model.w"].size = torch.Size([10**7, 10**7])

    _altered_index(step, huge)
    allocated: list[tuple] = []
    real_empty = torch.empty

    def empty(*size, **kwargs):  # what the export allocates a tensor with
        allocated.append(size)
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    index = SafeFileSystemReader(step).read_metadata().storage_data
    stored = next(info.length for key, info in index.items() if key.fqn == "model.w")
    want = (
        f"checkpoint {step}: .metadata gives model.w as [10000000, 10000000] float32 "
        f"(400,000,000,000,000 bytes), but its chunks are stored in {stored:,} bytes: a damaged "
        "or altered checkpoint, not read"
    )
    for out in ("m.pt", "m.safetensors", "folder"):
        assert want in _one_error(["ckpt", "export", str(step), str(tmp_path / out)], capsys)
        assert not (tmp_path / out).exists()
    assert allocated == []
