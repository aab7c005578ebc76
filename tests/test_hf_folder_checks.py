"""``--model hf:PATH`` folders are input from elsewhere: a malformed config.json or index, a damaged
or missing safetensors file, an index entry outside the folder are one line and exit code 2 before
any worker starts. The folders are built by hand (safetensors, a dev dependency, writes the
weights); the index is read before the config, so these need no transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp2lab import cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.models.hf_weights import INDEX
from fsdp2lab.plan import resolve_here

safetensors_torch = pytest.importorskip("safetensors.torch")


def model_folder(where: Path, *, index: object = None, files: dict | None = None) -> Path:
    """A folder as save_pretrained writes one: config.json, the safetensors ``files``
    ({name: tensors}), and ``index`` as model.safetensors.index.json (None: no index)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name, tensors in (files or {}).items():
        safetensors_torch.save_file(tensors, str(where / name))
    if index is not None:
        (where / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))
    return where


SHARD = {"model-00001-of-00001.safetensors": {"lm_head.weight": torch.zeros(8, 4)}}


def truncated(d: Path) -> None:
    model_folder(d, files=SHARD)
    file = d / "model-00001-of-00001.safetensors"
    file.write_bytes(file.read_bytes()[:-16])


def outside(d: Path) -> None:
    """An index entry naming a real safetensors file beside the folder."""
    model_folder(d.parent / "outside", files={"x.safetensors": SHARD[next(iter(SHARD))]})
    model_folder(d, index={"weight_map": {"lm_head.weight": "../outside/x.safetensors"}})


# Each bad folder ({d}) and its one line; docs/reliability.md names these by their ids.
BAD_FOLDERS = {
    "config-not-json": (
        lambda d: (model_folder(d) / "config.json").write_text('{"model_type": llama}'),
        "--model hf:{d}: {d}/config.json is not valid JSON (Expecting value: line 1 column 16 "
        "(char 15))",
    ),
    "config-not-an-object": (
        lambda d: (model_folder(d) / "config.json").write_text("[]"),
        "--model hf:{d}: {d}/config.json is not a JSON object",
    ),
    "index-not-json": (
        lambda d: model_folder(d, index='{"weight_map": {', files=SHARD),
        "--model hf:{d}: "
        + INDEX
        + " is not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 17 (char 16))",
    ),
    "index-without-weight-map": (
        lambda d: model_folder(d, index={"metadata": {}}, files=SHARD),
        "--model hf:{d}: " + INDEX + " has no weight_map (an object of tensor name: file name)",
    ),
    "index-entry-not-a-name": (
        lambda d: model_folder(d, index={"weight_map": {"lm_head.weight": 3}}, files=SHARD),
        "--model hf:{d}: " + INDEX + ": weight_map['lm_head.weight'] is 3, not a file name",
    ),
    "index-entry-outside-the-folder": (
        outside,
        "--model hf:{d}: "
        + INDEX
        + ": weight_map['lm_head.weight'] names ../outside/x.safetensors, "
        "outside the model's folder",
    ),
    "index-names-a-missing-file": (
        lambda d: model_folder(d, index={"weight_map": {"lm_head.weight": "gone.safetensors"}}),
        "--model hf:{d}: " + INDEX + " names gone.safetensors, which is missing",
    ),
    "truncated-safetensors": (
        truncated,
        "--model hf:{d}: model-00001-of-00001.safetensors is not a readable safetensors file "
        "(Error while deserializing header: incomplete metadata, file not fully covered)",
    ),
    "not-safetensors": (
        lambda d: (model_folder(d) / "model.safetensors").write_bytes(b"<html>404</html>"),
        "--model hf:{d}: model.safetensors is not a readable safetensors file (Error while "
        "deserializing header: header too large)",
    ),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_bad_hf_folder_is_one_line_before_any_worker(case, tmp_path):
    make, message = BAD_FOLDERS[case]
    folder = tmp_path / "model"
    make(folder)
    with pytest.raises(UsageError) as raised:
        resolve_here(TrainConfig(model=f"hf:{folder}"), 1)
    assert str(raised.value) == message.format(d=folder.resolve())


def test_through_the_cli_it_is_one_line_and_exit_code_2(tmp_path, capsys):
    folder = tmp_path / "model"
    outside(folder)
    assert cli.main(["train", "--model", f"hf:{folder}", "--nproc-per-node", "2"]) == 2
    out = capsys.readouterr()
    message = BAD_FOLDERS["index-entry-outside-the-folder"][1].format(d=folder.resolve())
    assert (out.out, out.err) == ("", f"fsdp2lab: error: {message}\n")


def test_files_linked_into_a_hub_cache_snapshot_are_read(tmp_path):
    """``hf download`` links a snapshot's files to blobs outside it: the index's names are
    checked, not where their links lead."""
    from fsdp2lab.models.hf_weights import WeightIndex

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    safetensors_torch.save_file({"lm_head.weight": torch.zeros(8, 4)}, str(blobs / "0123abcd"))
    index = {"weight_map": {"lm_head.weight": "model.safetensors"}}
    snapshot = model_folder(tmp_path / "snapshots" / "rev", index=index)
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/0123abcd"))
    index = WeightIndex.read(snapshot)
    assert index.files == {"lm_head.weight": "model.safetensors"}
    assert index.shapes == {"lm_head.weight": (8, 4)}
