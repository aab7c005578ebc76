"""``--dataset tokens:DIR`` is input from elsewhere: its header and files are checked against each
other and against the model before any worker starts (the files built here by hand, so no
tokenizer is needed). ``data prepare`` itself: tests/test_token_prepare.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import GPT_TINY
from fsdp2lab import cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.data import token_windows, tokens
from fsdp2lab.errors import UsageError
from fsdp2lab.plan import resolve_here

VOCAB = 320  # the model's (--vocab-size)


def token_folder(where: Path, *, dtype: str = "uint16", largest: int = 299, **header) -> Path:
    """A token folder as ``data prepare`` writes it: 400 training and 100 held-out tokens whose
    largest id is ``largest``; ``header`` overrides the header's fields (None: removed)."""
    where.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    train = rng.integers(0, largest, 400).astype(dtype)
    train[7] = largest
    val = rng.integers(0, largest, 100).astype(dtype)
    train.tofile(where / "train.bin")
    val.tofile(where / "val.bin")
    fields = {
        "format": tokens.FORMAT,
        "tokenizer": "/somewhere/tokenizer",
        "tokenizer_sha256": "0" * 64,
        "vocab_size": 300,
        "eos_id": 0,
        "dtype": dtype,
        "max_token_id": largest,
        "documents": 10,
        "train_tokens": 400,
        "val_tokens": 100,
    }
    fields.update(header)
    fields = {k: v for k, v in fields.items() if v is not None}
    (where / tokens.HEADER).write_text(json.dumps(fields))
    return where


def check(folder: Path) -> None:
    resolve_here(TrainConfig(model="gpt", dataset=f"tokens:{folder}", vocab_size=VOCAB), 1)


def test_a_whole_folder_is_accepted_and_read(tmp_path):
    folder = token_folder(tmp_path / "t")
    check(folder)
    check(token_folder(tmp_path / "t32", dtype="uint32", largest=VOCAB - 1))
    train, val = token_windows.load(str(folder), 16)
    assert len(train) == (400 - 1) // 16 and len(val) == (100 - 1) // 16


def shorter(folder: Path) -> None:  # a prepare cut short: the file holds fewer tokens
    data = (folder / "train.bin").read_bytes()
    (folder / "train.bin").write_bytes(data[: len(data) // 2])


def odd(folder: Path) -> None:  # half a uint16 token at the end
    with open(folder / "train.bin", "ab") as f:
        f.write(b"\0")


# Each bad folder and the one line it gives (the folder is {d}); tests/test_token_prepare.py and
# docs/reliability.md name these by their ids.
BAD_FOLDERS = {
    "ids-above-the-vocabulary": (
        lambda d: token_folder(d, largest=400),
        "--dataset tokens:{d}: its largest token id is 400, beyond the model's vocabulary "
        "(320 tokens: ids 0 to 319)",
    ),
    "ids-above-the-vocabulary-without-max-token-id": (  # the header's vocabulary says 300
        lambda d: token_folder(d, largest=400, max_token_id=None),
        "--dataset tokens:{d}: its largest token id is 400 (read from its files: tokens.json has "
        "none), beyond the model's vocabulary (320 tokens: ids 0 to 319)",
    ),
    "train-shorter-than-its-header": (
        lambda d: shorter(token_folder(d)),
        "{d}/train.bin: 400 bytes, but tokens.json gives 400 uint16 tokens (800 bytes): an "
        "unfinished or altered file; make the folder again with `fsdp2lab data prepare`",
    ),
    "odd-length": (
        lambda d: odd(token_folder(d)),
        "{d}/train.bin: 801 bytes, but tokens.json gives 400 uint16 tokens (800 bytes): an "
        "unfinished or altered file; make the folder again with `fsdp2lab data prepare`",
    ),
    "wrong-dtype": (
        lambda d: token_folder(d, dtype="int64"),
        "{d}/tokens.json: dtype 'int64'; token files are uint16 or uint32",
    ),
    "missing-val": (
        lambda d: (token_folder(d) / "val.bin").unlink(),
        "{d}/val.bin: missing (tokens.json counts 100 tokens in it); make the folder again with "
        "`fsdp2lab data prepare`",
    ),
    "a-count-that-is-not-one": (
        lambda d: token_folder(d, train_tokens="400"),
        "{d}/tokens.json: train_tokens is '400', not a count",
    ),
    "header-not-json": (
        lambda d: (token_folder(d) / tokens.HEADER).write_text('{"format": '),
        "{d}/tokens.json:1: not valid JSON (Expecting value, column 12)",
    ),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_bad_token_folder_is_one_line_before_any_worker(case, tmp_path):
    make, message = BAD_FOLDERS[case]
    folder = tmp_path / "t"
    make(folder)
    with pytest.raises(UsageError) as raised:
        check(folder)
    assert str(raised.value) == message.format(d=folder)


def test_through_the_cli_it_is_one_line_and_exit_code_2(tmp_path, capsys):
    folder = token_folder(tmp_path / "t", largest=400)
    args = ["train", *GPT_TINY, "--vocab-size", str(VOCAB), "--dataset", f"tokens:{folder}",
            "--nproc-per-node", "2", "--progress", "off"]  # fmt: skip
    assert cli.main(args) == 2
    out = capsys.readouterr()
    assert out.err == f"fsdp2lab: error: {BAD_FOLDERS['ids-above-the-vocabulary'][1]}\n".format(
        d=folder
    )
    assert out.out == ""


def test_ids_past_the_vocabulary_without_a_recorded_largest_id_are_one_line(tmp_path, capsys):
    """A header without ``max_token_id`` whose files hold ids past the model's vocabulary (its
    own ``vocab_size`` below the model's): the files are read at start, one line, exit code 2,
    no worker started (an ``IndexError`` traceback before)."""
    folder = token_folder(tmp_path / "t", largest=400, max_token_id=None)
    args = ["train", *GPT_TINY, "--vocab-size", str(VOCAB), "--dataset", f"tokens:{folder}",
            "--nproc-per-node", "2", "--progress", "off"]  # fmt: skip
    assert cli.main(args) == 2
    out = capsys.readouterr()
    message = BAD_FOLDERS["ids-above-the-vocabulary-without-max-token-id"][1].format(d=folder)
    assert out.err == f"fsdp2lab: error: {message}\n"
    assert out.out == ""


def test_a_header_without_the_largest_id_is_checked_by_its_vocabulary(tmp_path):
    """A header written before the largest id was recorded: its tokenizer's vocabulary bounds
    the ids."""
    check(token_folder(tmp_path / "ok", max_token_id=None))
    with pytest.raises(UsageError, match=r"its tokenizer's vocabulary \(400 tokens\) is larger"):
        check(token_folder(tmp_path / "big", max_token_id=None, vocab_size=400))


def test_prepare_without_tokenizers_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    args = ["data", "prepare", "--tokenizer", str(tmp_path), "--input", str(tmp_path / "a.txt"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (
        "fsdp2lab: error: data prepare needs the tokenizers package: pip install 'fsdp2lab[hf]'\n"
    )
    assert not (tmp_path / "out").exists()
