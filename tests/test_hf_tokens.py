"""``fsdp2lab data prepare`` and ``--dataset tokens:DIR``: your tokenizer (trained here with the
``tokenizers`` library on local text), your text (plain, JSON lines, parquet) as a memory-mapped
token file, and training windows in a world-size-independent order that no rank materialises.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import GPT_TINY, assert_close_lists, run_cli, train
from fsdp2lab import cli
from fsdp2lab.config import TrainConfig
from fsdp2lab.data.token_windows import TokenWindows, WindowOrder, load
from fsdp2lab.errors import UsageError
from fsdp2lab.plan import resolve_here

pytestmark = [pytest.mark.hf]
tokenizers = pytest.importorskip("tokenizers")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "ranks",
    "gather",
    "shards",
    "and",
    "reduce",
    "gradients",
    "of",
    "every",
    "layer",
    "in",
    "turn",
]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def make_tokenizer(folder: Path, *, eos: str | None = "<eos>", vocab: int = 300) -> Path:
    """A byte-level BPE trained on local text, saved as transformers would find it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents(200), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos:
        config["eos_token"] = eos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("corpus")
    docs = documents(600, seed=1)
    text = where / "a.txt"
    text.write_text(docs[0])
    jsonl = where / "b.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[1:300]))
    )
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    parquet = where / "c.parquet"
    pq.write_table(pa.table({"body": docs[300:]}), parquet, row_group_size=64)
    tokenizer = make_tokenizer(where / "tokenizer")
    return {"where": where, "docs": docs, "files": [text, jsonl, parquet], "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def token_dir(corpus) -> Path:
    out = corpus["where"] / "tokens"
    files = [str(f) for f in corpus["files"]]
    # The parquet file's text column is named body: --field applies to JSON lines and parquet.
    jsonl_as_body = corpus["where"] / "b-body.jsonl"
    jsonl_as_body.write_text(corpus["files"][1].read_text().replace('"text"', '"body"'))
    files[1] = str(jsonl_as_body)
    args = ["data", "prepare", "--tokenizer", str(corpus["tokenizer"]), "--input", *files,
            "--out", str(out), "--field", "body", "--val-fraction", "0.1", "--progress", "off"]  # fmt: skip
    assert cli.main(args) == 0
    return out


def test_prepare_writes_every_documents_tokens_and_an_eos_after_each(corpus, token_dir):
    from tokenizers import Tokenizer

    header = json.loads((token_dir / "tokens.json").read_text())
    tok = Tokenizer.from_file(str(corpus["tokenizer"] / "tokenizer.json"))
    eos = tok.token_to_id("<eos>")
    expected = [i for d in corpus["docs"] for i in [*tok.encode(d).ids, eos]]
    train = np.fromfile(token_dir / "train.bin", dtype=np.uint16)
    val = np.fromfile(token_dir / "val.bin", dtype=np.uint16)
    assert np.concatenate([train, val]).tolist() == expected
    assert len(val) == int(len(expected) * 0.1) > 0
    assert header["dtype"] == "uint16" and header["eos_id"] == eos
    assert header["vocab_size"] == tok.get_vocab_size() == 300
    assert header["documents"] == 600
    assert (header["train_tokens"], header["val_tokens"]) == (len(train), len(val))
    assert len(header["tokenizer_sha256"]) == 64


def test_a_tokenizer_without_eos_needs_eos(corpus, tmp_path, capsys):
    bare = make_tokenizer(tmp_path / "bare", eos=None)
    args = ["data", "prepare", "--tokenizer", str(bare), "--input", str(corpus["files"][1]),
            "--out", str(tmp_path / "t"), "--progress", "off"]  # fmt: skip
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (
        f"fsdp2lab: error: --tokenizer {bare} names no EOS token: give --eos TOKEN (a token of "
        "its vocabulary that ends a document)\n"
    )
    assert cli.main([*args, "--eos", "<eos>"]) == 0
    assert json.loads((tmp_path / "t" / "tokens.json").read_text())["eos_id"] == 0


def test_window_order_is_a_seeded_bijection_computed_per_index():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        order = WindowOrder(n, seed=1, epoch=1)
        assert sorted(order[0:n].tolist()) == list(range(n)), n
        # Any slice is the same part of the whole order (what each rank computes).
        assert order[n // 3 : n // 2].tolist() == order[0:n].tolist()[n // 3 : n // 2]
    a, b, c = (WindowOrder(1000, s, e)[0:1000].tolist() for s, e in ((1, 1), (2, 1), (1, 2)))
    assert a != b and a != c and a != list(range(1000))
    # 1 GiB of uint16 tokens at seq-len 64: 8M windows; a batch's indices without 8M of anything.
    big = WindowOrder(8 << 20, seed=1, epoch=1)
    batch = big[5_000_000:5_000_064]
    assert len(set(batch.tolist())) == 64 and int(batch.min()) >= 0 and int(batch.max()) < 8 << 20


def test_windows_are_read_from_the_memory_map(token_dir):
    train, val = load(str(token_dir), 16)
    assert isinstance(train, TokenWindows) and isinstance(train.tokens, np.memmap)
    tokens = np.fromfile(token_dir / "train.bin", dtype=np.uint16).astype(np.int64)
    x, y = train.__getitems__([0, 5, len(train) - 1])
    for row, i in enumerate([0, 5, len(train) - 1]):
        assert x[row].tolist() == tokens[i * 16 : i * 16 + 16].tolist()
        assert y[row].tolist() == tokens[i * 16 + 1 : i * 16 + 17].tolist()
    assert len(train) == (len(tokens) - 1) // 16 and len(val) > 0


STEPS = 20
GPT = [*GPT_TINY, "--vocab-size", "320", "--progress", "off", "--dropout", "0"]


def test_gpt_on_tokens_fsdp2_matches_one_process_and_resumes_at_another_world_size(
    token_dir, tmp_path
):
    common = [*GPT, "--dataset", f"tokens:{token_dir}", "--global-batch-size", "16",
              "--max-steps", str(STEPS), "--log-every-steps", "1", "--optimizer", "adam",
              "--lr", "3e-3"]  # fmt: skip
    single = train(tmp_path, *common, "--strategy", "single", name="single")
    reference = single.step_losses
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5, reference
    two = train(tmp_path, *common, "--nproc-per-node", "2", "--ckpt-dir", str(tmp_path / "ck"),
                "--ckpt-every-steps", "10", name="two")  # fmt: skip
    # Another world size adds in another order: FSDP2 follows one process up to that rounding.
    assert_close_lists(two.step_losses, reference, 1e-5)
    assert "token windows of" in two.stdout + two.stderr
    # A resume at the same world size is exact: the same windows, state and order, bit for bit.
    again = train(tmp_path, *common, "--nproc-per-node", "2", "--resume",
                  str(tmp_path / "ck" / "step-10"), name="again")  # fmt: skip
    assert again.step_losses == two.step_losses[10:]
    # At another world size it reads the same windows; the sums' order is the new layout's.
    resumed = train(tmp_path, *common, "--nproc-per-node", "4", "--fsdp-units", "layer",
                    "--resume", str(tmp_path / "ck" / "step-10"), name="resumed")  # fmt: skip
    assert_close_lists(resumed.step_losses, reference[10:], 1e-5)


def test_bad_token_files_are_one_line_before_any_worker(corpus, token_dir, tmp_path):
    with pytest.raises(UsageError, match=r"its largest token id is 2\d\d, beyond the model's "
                                         r"vocabulary \(256 tokens: ids 0 to 255\)"):  # fmt: skip
        resolve_here(TrainConfig(model="gpt", dataset=f"tokens:{token_dir}", vocab_size=256), 2)
    other = make_tokenizer(tmp_path / "other", vocab=290)
    proc = run_cli(["train", *GPT, "--dataset", f"tokens:{token_dir}", "--tokenizer", str(other),
                    "--nproc-per-node", "2"], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        f"fsdp2lab: error: --dataset tokens:{token_dir} was made with another tokenizer "
        f"({corpus['tokenizer'].resolve()}) than --tokenizer {other} (their files' hashes differ)\n"
    )
    with pytest.raises(UsageError, match=r"no tokens.json there"):
        resolve_here(TrainConfig(model="gpt", dataset=f"tokens:{tmp_path}"), 1)
    # The same tokenizer: accepted.
    same = str(corpus["tokenizer"])
    resolve_here(
        TrainConfig(model="gpt", dataset=f"tokens:{token_dir}", vocab_size=320, tokenizer=same), 1
    )
