"""Where ``ckpt export`` and ``train --save-hf`` write: only a folder fsdp2lab wrote (it carries
the ``.fsdp2lab-export`` mark) is replaced; the leftovers of saves whose process died are removed
at the next save beside them, and said; a crash while a folder is replaced leaves a good folder
under its name, or the next run puts it back; every refusal of a ``--save-hf`` folder, and too
little free space for the save, come before any worker starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env, run_cli, tmpfs
from fsdp2lab import cli
from fsdp2lab.checkpoint import layout
from fsdp2lab.checkpoint import safetensors_export as st_export
from fsdp2lab.checkpoint.state import MODEL, RUN
from fsdp2lab.errors import UsageError

pytestmark = [pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")]
MARK = ".fsdp2lab-export"
HOST = os.uname().nodename
WEIGHTS = {"a": torch.ones(40), "b": torch.zeros(40)}  # 320 bytes


def _save(path: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A complete checkpoint of ``weights`` as the trainer lays it out."""
    import torch.distributed.checkpoint as dcp

    dcp.save({MODEL: dict(weights), RUN: json.dumps({"model": "test"})}, checkpoint_id=path,
             no_dist=True)  # fmt: skip
    layout.mark_complete(path, {"step": 3, "contents": [MODEL, RUN]})
    return path


def dead_pid() -> int:
    """The id of a process of this host that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def save_pretrained_style(folder: Path) -> dict[str, bytes]:
    """Another model's folder, as ``save_pretrained`` and a tokenizer write it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"another model's weights")
    (folder / "tokenizer.json").write_text("{}")
    return contents(folder)


def leftover(parent: Path, target: str, pid: int, host: str = HOST, marked: bool = True) -> Path:
    """The hidden temporary folder a save of ``target`` by process ``pid`` leaves when it dies
    (a killed rank 0, a failed async save): shards, and fsdp2lab's mark."""
    folder = parent / f".{target}.tmp-{host}-{pid}"
    (folder / "sharded").mkdir(parents=True)
    (folder / "sharded" / "shard_00001.safetensors").write_bytes(b"x" * 1000)
    if marked:
        (folder / MARK).write_text(json.dumps({"host": host, "pid": pid}))
    return folder


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------- ckpt export
def test_ckpt_export_refuses_a_folder_fsdp2lab_did_not_write(tmp_path, capsys):
    ckpt = _save(tmp_path / "step-3", WEIGHTS)
    out = tmp_path / "hf"
    before = save_pretrained_style(out)
    assert cli.main(["ckpt", "export", str(ckpt), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"fsdp2lab: error: export to {out} refused: fsdp2lab did not write that folder (it has no "
        f"{MARK} mark) and it holds config.json, model.safetensors, tokenizer.json; give a new or "
        "empty folder\n"
    )
    assert contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "step-3"]


def test_an_earlier_export_is_replaced_and_every_export_carries_the_mark(tmp_path):
    ckpt = _save(tmp_path / "step-3", WEIGHTS)
    out = tmp_path / "out"
    assert cli.main(["ckpt", "export", str(ckpt), str(out), "--format", "safetensors"]) == 0
    assert sorted(contents(out)) == [MARK, "model.safetensors"]
    assert json.loads((out / MARK).read_text())["host"] == HOST
    assert cli.main(["ckpt", "export", str(ckpt), str(out), "--max-shard-size", "200"]) == 0
    assert sorted(contents(out)) == [MARK, "model-00001-of-00002.safetensors",
                                     "model-00002-of-00002.safetensors", st_export.INDEX_FILE]  # fmt: skip
    assert hidden(tmp_path) == []


def test_leftovers_of_dead_saves_are_removed_at_the_next_export_and_said(tmp_path, capsys):
    ckpt = _save(tmp_path / "step-3", WEIGHTS)
    out = tmp_path / "out"
    killed_pid, failed_pid = dead_pid(), dead_pid()
    killed = leftover(tmp_path, "out", killed_pid)  # a killed rank 0's
    failed = leftover(tmp_path, "other", failed_pid)  # a failed save of another folder beside it
    with subprocess.Popen(["sleep", "60"]) as running:
        live = leftover(tmp_path, "out", running.pid)  # a save still being written
        elsewhere = leftover(tmp_path, "out", killed_pid, host="another-host")
        unmarked = leftover(tmp_path, "out", failed_pid, marked=False)  # not known to be ours
        try:
            assert cli.main(["ckpt", "export", str(ckpt), str(out), "--format", "safetensors"]) == 0
        finally:
            running.kill()
    said = capsys.readouterr().out
    for gone, pid in ((killed, killed_pid), (failed, failed_pid)):
        assert not gone.exists()
        line = f"fsdp2lab: removed {gone}, an unfinished save left by process {pid} on {HOST}, "
        assert line + "which no longer runs\n" in said, said
    for kept in (live, elsewhere, unmarked):
        assert (kept / "sharded" / "shard_00001.safetensors").read_bytes() == b"x" * 1000
    assert hidden(tmp_path) == sorted(p.name for p in (live, elsewhere, unmarked))
    assert sorted(contents(out)) == [MARK, "model.safetensors"]


# A process that dies (os._exit) in the middle of replacing OUT, after its first rename.
CRASH = """
import os, sys
from fsdp2lab.checkpoint import safetensors_export, targets
ckpt, out, way = sys.argv[1:]
if way == "set-aside":  # no atomic swap: the old folder renamed aside, the new one not yet in
    targets._exchange = lambda a, b: False
    real = targets._set_aside
    def crash(out):
        real(out)
        os._exit(9)
    targets._set_aside = crash
else:  # swapped: the new folder in place, the old one under the temporary name
    targets.remove = lambda folder: os._exit(9)
safetensors_export.export_safetensors(ckpt, out, max_shard_size=200)
"""


@pytest.mark.parametrize("way", ["set-aside", "swapped"])
def test_a_crash_while_replacing_leaves_a_good_folder_or_the_next_run_puts_it_back(tmp_path, way):
    from fsdp2lab.checkpoint import targets

    ckpt = _save(tmp_path / "step-3", WEIGHTS)
    out = tmp_path / "out"
    st_export.export_safetensors(ckpt, out)
    first = contents(out)
    crash = [sys.executable, "-c", CRASH, str(ckpt), str(out), way]
    proc = subprocess.run(crash, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    if way == "set-aside":
        assert not out.exists()  # the window: nothing under the name until the next run
    else:
        assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2  # the new one, whole
    lines = targets.tidy(tmp_path)  # what the next export or --save-hf run does first
    if way == "set-aside":
        assert contents(out) == first  # put back, byte for byte
        assert lines[0].startswith(f"put back {out} from .out.old-{HOST}-"), lines
    assert lines[-1].startswith(f"removed {tmp_path}/.out.tmp-{HOST}-"), lines
    assert hidden(tmp_path) == []


def test_ckpt_export_without_room_for_the_save_is_refused_before_reading(tmp_path, monkeypatch,
                                                                         capsys):  # fmt: skip
    ckpt = _save(tmp_path / "step-3", WEIGHTS)
    out = tmp_path / "out"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100))

    def never(*args):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(st_export, "load_tensor", never)
    assert cli.main(["ckpt", "export", str(ckpt), str(out), "--format", "safetensors"]) == 2
    assert capsys.readouterr().err == (
        f"fsdp2lab: error: export to {out}: the save needs 640 bytes free (its shards and the "
        f"joined files), but {tmp_path} has 100 bytes free\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


# ---------------------------------------------------------------------------- --save-hf
def tiny_llama_config() -> dict:
    return dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama's config folder (``--model hf:PATH`` builds its weights from the seed)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaConfig(**tiny_llama_config()).save_pretrained(folder)
    return folder


@pytest.mark.hf
def test_save_hf_refusals_come_before_any_worker_starts(llama, tmp_path):
    out = tmp_path / "hf"
    before = save_pretrained_style(out)
    proc = run_cli(["train", "--model", f"hf:{llama}", "--nproc-per-node", "2", "--max-steps",
                    "1", "--seq-len", "16", "--save-hf", str(out)], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        f"fsdp2lab: error: export to {out} refused: fsdp2lab did not write that folder (it has no "
        f"{MARK} mark) and it holds config.json, model.safetensors, tokenizer.json; give a new or "
        "empty folder\n"
    )
    # A worker's first line is the resolved config; a rank's lines but rank 0's carry [rank N].
    assert "resolved config" not in proc.stdout and "[rank" not in proc.stdout + proc.stderr
    assert contents(out) == before


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder``, where nothing can be written (root writes through permissions: a read-only
    file system then)."""
    if os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    with tmpfs(folder, "1m"):
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder


def _plan(llama: Path, out: Path, **flags) -> None:
    from fsdp2lab.config import TrainConfig
    from fsdp2lab.plan import resolve_here

    resolve_here(TrainConfig(model=f"hf:{llama}", save_hf=str(out), seq_len=16, **flags), 2)


@pytest.mark.hf
def test_every_save_hf_refusal_is_found_by_the_plan(llama, tmp_path):
    from test_token_files_safety import token_folder

    def refused(out: Path, message: str, **flags) -> None:
        with pytest.raises(UsageError) as caught:
            _plan(llama, out, **flags)
        assert message in str(caught.value), caught.value

    refused(llama, "it is the model folder the run started from")
    ckpt = tmp_path / "ckpt"
    refused(ckpt, "it is the checkpoint folder (--ckpt-dir)", ckpt_dir=str(ckpt))
    data = token_folder(tmp_path / "tokens", vocab_size=1000, largest=999)
    refused(data, "it is the token folder the run reads", dataset=f"tokens:{data}")
    other = tmp_path / "other"
    save_pretrained_style(other)
    refused(other, "fsdp2lab did not write that folder")
    (tmp_path / "file").write_text("mine")
    refused(tmp_path / "file", "exists and is not a folder")
    refused(tmp_path / "file" / "out", f"refused: {tmp_path / 'file'} is not a folder")
    with read_only(tmp_path / "ro") as folder:
        refused(folder / "out", f"refused: {folder} is not writable")
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.hf
def test_save_hf_without_room_for_the_save_is_refused_by_the_plan(llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    params = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_llama_config()))
    nbytes = 2 * sum(p.numel() * p.element_size() for p in params.parameters())
    assert nbytes > 1_000_000
    with tmpfs(tmp_path / "small", "1m") as small:
        with pytest.raises(UsageError) as caught:
            _plan(llama, small / "out")
        free = shutil.disk_usage(small).free
    assert str(caught.value) == (
        f"--save-hf {small / 'out'}: the save needs {nbytes / 1e6:.1f} MB free (its shards and "
        f"the joined files), but {small} has {free / 1e6:.1f} MB free"
    )


@pytest.mark.hf
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_save_hf_save_removes_what_a_dead_runs_save_left(one_rank, tmp_path, capsys,
                                                           asynchronous):  # fmt: skip
    transformers = pytest.importorskip("transformers")
    from fsdp2lab.checkpoint.hf_save import save_hf
    from fsdp2lab.checkpoint.state import hf_config_of

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_llama_config()))
    run = {"hf_config": hf_config_of(model), "hf_source": None, "companions": {}, "config": {}}
    out = tmp_path / "out"
    pid = dead_pid()
    killed = leftover(tmp_path, "out", pid)
    files = save_hf(model, out, run, asynchronous=asynchronous)
    if asynchronous:
        files = files.result()
    assert not killed.exists()
    said = capsys.readouterr().out
    assert f"fsdp2lab: removed {killed}, an unfinished save left by process {pid} on {HOST}" in said
    assert sorted(contents(out)) == [MARK, "config.json", "model.safetensors"]
    assert sorted(p.name for p in files) == ["config.json", "model.safetensors"]
    assert hidden(tmp_path) == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)
