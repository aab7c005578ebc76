"""``fsdp2lab data prepare`` on bad input: one line naming the file (and line), exit code 2, and the
output folder as it was; long documents encoded in pieces with the tokens of a whole encoding.
Needs tokenizers (a dev dependency); the parquet case needs pyarrow (the data extra): hf stage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import tmpfs
from fsdp2lab import cli
from fsdp2lab.data import tokens

tokenizers = pytest.importorskip("tokenizers")

from test_hf_tokens import documents, make_tokenizer  # noqa: E402 (needs tokenizers)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def prepare(tokenizer: Path, out: Path, *inputs: Path, extra: tuple[str, ...] = ()) -> int:
    return cli.main(["data", "prepare", "--tokenizer", str(tokenizer), "--input",
                     *map(str, inputs), "--out", str(out), "--progress", "off", *extra])  # fmt: skip


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def good_corpus(where: Path) -> Path:
    file = where / "good.jsonl"
    file.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(300)))
    return file


def bad_utf8(where: Path) -> tuple[Path, str]:
    file = where / "bad.txt"
    file.write_bytes(b"one line\nanother line\nthe third \xff line\n")
    return file, f"{file}:3: not UTF-8 text (byte 32)"


def bad_json(where: Path) -> tuple[Path, str]:
    file = where / "bad.jsonl"
    file.write_text('{"text": "a document"}\n{"text": "cut short"\n')
    return file, f"{file}:2: not a JSON line (Expecting ',' delimiter, column 21)"


def bad_utf8_line(where: Path) -> tuple[Path, str]:
    file = where / "bad-line.jsonl"
    file.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    return file, f"{file}:2: not UTF-8 text (byte 13 of the line)"


def int_column(where: Path) -> tuple[Path, str]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    file = where / "ids.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), file)
    return file, f"{file}: column 'text' holds int64, not text (choose another with --field)"


BAD_INPUTS = {
    "bad-utf8": bad_utf8,
    "invalid-json-line": bad_json,
    "bad-utf8-in-a-json-line": bad_utf8_line,
    "int-parquet-column": int_column,
}
ONLY_IN_HF_STAGE = {"int-parquet-column"}  # pyarrow is installed there


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.hf] if c in ONLY_IN_HF_STAGE else []) for c in BAD_INPUTS],
)
def test_a_failed_prepare_leaves_the_folder_as_it_was(case, tokenizer, tmp_path, capsys):
    """The probe of the issue: a prepare failing after some documents were written."""
    good, out = good_corpus(tmp_path), tmp_path / "out"
    assert prepare(tokenizer, out, good) == 0
    before = snapshot(out)
    bad, message = BAD_INPUTS[case](tmp_path)
    capsys.readouterr()
    assert prepare(tokenizer, out, good, bad) == 2
    assert capsys.readouterr().err == f"fsdp2lab: error: {message}\n"
    assert snapshot(out) == before  # no temporary file left either


def test_a_corpus_without_a_window_is_refused_and_no_folder_is_made(tokenizer, tmp_path, capsys):
    empty, short = tmp_path / "empty.jsonl", tmp_path / "short.txt"
    empty.write_text("")
    short.write_text("the fox")
    good = good_corpus(tmp_path)
    cases = [
        ((empty,), (), f"--input {empty}: its 0 tokens leave 0 for train.bin, fewer than one "
                       "window (2 tokens at --seq-len 1): a larger corpus, or another --val-fraction"),
        ((short,), (), f"--input {short}: its 4 tokens leave 0 for val.bin, fewer than one window"
                       " (2 tokens at --seq-len 1): a larger corpus, or another --val-fraction"),
        ((good,), ("--val-fraction", "0"), "--val-fraction must be in (0, 1), got 0.0 (val.bin, "
                                          "the held-out tokens, is what evaluation reads)"),
    ]  # fmt: skip
    for inputs, extra, message in cases:
        capsys.readouterr()
        assert prepare(tokenizer, tmp_path / "out", *inputs, extra=extra) == 2
        assert capsys.readouterr().err == f"fsdp2lab: error: {message}\n"
        assert not (tmp_path / "out").exists()


def test_a_broken_tokenizer_is_one_line(tmp_path, capsys):
    good = good_corpus(tmp_path)
    broken = make_tokenizer(tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert prepare(broken, tmp_path / "out", good) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsdp2lab: error: --tokenizer {broken}: {broken}/tokenizer.json cannot")
    assert err.count("\n") == 1
    config = make_tokenizer(tmp_path / "config")
    (config / "tokenizer_config.json").write_text('{"eos_token": ')
    assert prepare(config, tmp_path / "out", good) == 2
    assert capsys.readouterr().err == (
        f"fsdp2lab: error: {config}/tokenizer_config.json:1: not valid JSON (Expecting value, "
        "column 15)\n"
    )


def test_ids_above_the_models_vocabulary_are_refused_before_any_worker(tokenizer, tmp_path):
    from fsdp2lab.config import TrainConfig
    from fsdp2lab.errors import UsageError
    from fsdp2lab.plan import resolve_here

    out = tmp_path / "out"
    assert prepare(tokenizer, out, good_corpus(tmp_path)) == 0
    largest = json.loads((out / "tokens.json").read_text())["max_token_id"]
    assert 256 < largest < 300  # merges used, the vocabulary's last ids not
    with pytest.raises(UsageError, match=f"its largest token id is {largest}, beyond"):
        resolve_here(TrainConfig(model="gpt", dataset=f"tokens:{out}", vocab_size=256), 1)
    resolve_here(TrainConfig(model="gpt", dataset=f"tokens:{out}", vocab_size=largest + 1), 1)


TEXT = "  the quick   brown fox,\n\njumps  over\ta lazy dog!! while 12345 ranks gather\n "


@pytest.mark.parametrize("bos", [False, True])
def test_a_long_document_in_pieces_has_the_tokens_of_a_whole_encoding(bos, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, processors

    folder = make_tokenizer(tmp_path / "tok")
    if bos:  # a post-processor that puts a BOS before each document: once, not per piece
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_special_tokens(["<bos>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
        )
        tok.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = [TEXT * 40, "short", " ".join(documents(30))]
    monkeypatch.setattr(tokens, "PIECE_CHARS", 64)
    monkeypatch.setattr(tokens, "BATCH_CHARS", 200)
    assert len(list(tokens.pieces(docs[0], 64))) > 40
    assert all("".join(tokens.pieces(d, 64)) == d for d in docs)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    assert prepare(folder, out, tmp_path / "in.jsonl", extra=("--val-fraction", "0.1")) == 0
    written = np.concatenate(
        [np.fromfile(out / f, dtype=np.uint16) for f in ("train.bin", "val.bin")]
    )
    eos = tok.token_to_id("<eos>")
    assert written.tolist() == [i for d in docs for i in [*tok.encode(d).ids, eos]]


@pytest.mark.slow  # 1-4 minutes on a busy 2-core machine
def test_a_100_mb_one_line_document_takes_under_1_gb(tokenizer, tmp_path):
    """A JSON line whose text is 100 MB, prepared in a process of its own: its peak resident
    memory (VmHWM) stays under 1 GB. Not ru_maxrss: a child inherits
    its parent's high-water mark across fork and exec (this test's pytest process, 1.2 GB late
    in the slow stage)."""
    words = " ".join(documents(2000, seed=3)) + " "
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"text": words * (100_000_000 // len(words) + 1)}) + "\n")
    code = (
        "import re, sys; from fsdp2lab import cli; "
        f"rc = cli.main(['data', 'prepare', '--tokenizer', {str(tokenizer)!r}, '--input', "
        f"{str(big)!r}, '--out', {str(tmp_path / 'out')!r}, '--progress', 'off']); "
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]); "
        "sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    peak_mb = int(proc.stdout.split()[-1]) / 1024
    print(f"[100 MB document] peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 1024
    header = json.loads((tmp_path / "out" / "tokens.json").read_text())
    assert header["documents"] == 1 and header["train_tokens"] > 10_000_000


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize("kind", ["llama3-split", "metaspace", "whitespace"])
def test_pieces_give_the_whole_texts_tokens_for_pre_tokenizers_that_start_words_at_spaces(kind):
    """The guarantee of tokens.pieces beyond byte-level BPE (tested above): Llama 3's split
    (punctuation takes the newlines after it), SentencePiece's Metaspace, whitespace splitting."""
    import random

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    words = [
        "the",
        "quick",
        "brown",
        "fox,",
        "jumps!",
        "over",
        "a",
        "lazy",
        "dog\n",
        "12345",
        "ranks\tgather:",
        "shards?",
    ]
    rng = random.Random(0)
    ends = [" ", "  ", "\n", " \n ", "!\n", ""]
    text = "".join(rng.choice(words) + rng.choice(ends) for _ in range(3000))
    pre = {
        "llama3-split": pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        ),
        "metaspace": pre_tokenizers.Metaspace(prepend_scheme="always"),
        "whitespace": pre_tokenizers.WhitespaceSplit(),
    }[kind]  # fmt: skip
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind == "llama3-split" else []
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]"], initial_alphabet=alphabet
    )
    tok.train_from_iterator([text[i : i + 500] for i in range(0, len(text), 500)], trainer)
    parts = list(tokens.pieces(text, 97))
    assert len(parts) > 100
    assert [i for p in parts for i in tok.encode(p).ids] == tok.encode(text).ids


def test_a_full_disk_is_one_line_and_the_folder_stays_as_it_was(tokenizer, tmp_path, capsys):
    """A real ENOSPC (a 64 KB tmpfs): the error names the file, and the last prepare stays."""
    corpus = tmp_path / "big.txt"
    corpus.write_text(" ".join(documents(3000)))  # ~110 KB of uint16 tokens: past the disk
    with tmpfs(tmp_path / "disk", "64k") as disk:
        out = disk / "out"
        assert prepare(tokenizer, out, good_corpus(tmp_path)) == 0
        before = snapshot(out)
        capsys.readouterr()
        assert prepare(tokenizer, out, corpus) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(
            rf"fsdp2lab: error: --out {out}: cannot write the token file \({out}: No space left "
            rf"on device\); nothing in {out} changed\n",
            err,
        ), err
        assert snapshot(out) == before
