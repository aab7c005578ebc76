"""Your tokenizer, your text: a flat memory-mapped token file, and training windows read from it.

``fsdp2lab data prepare`` tokenizes text files (one document each), JSON lines (a ``text`` field,
or ``--field``) and parquet files (the same field; the ``data`` extra brings pyarrow) once, with
an EOS token after every document, into ``DIR/train.bin`` and ``DIR/val.bin`` (uint16, or uint32
for vocabularies above 65,536) and a small header ``DIR/tokens.json``: the tokenizer, a hash of
its files, its vocabulary size, the EOS id and the token counts. The last ``--val-fraction`` of the
tokens is written apart as ``val.bin``: what evaluation reads.

``--dataset tokens:DIR`` trains on windows of ``--seq-len + 1`` tokens (consecutive windows share
one token, so every token is a target once) read from the memory map, never loading the file: a
rank's memory does not grow with the corpus. The epoch's order is a seeded bijection of the window
indices computed per index (:class:`WindowOrder`), never a materialised permutation, and is the
same at every world size, so a run resumes exactly on another number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fsdp2lab.errors import UsageError

PREFIX = "tokens:"
HEADER = "tokens.json"
FORMAT = "fsdp2lab-tokens/1"
# The files of a tokenizer folder that decide its tokens (hashed in this order, where present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
DOCUMENTS_PER_BATCH = 256


def is_tokens(name: str) -> bool:
    return name.startswith(PREFIX)


# ---------------------------------------------------------------------------- the tokenizer
@dataclass(frozen=True)
class Tokenizer:
    path: Path
    vocab_size: int
    eos_id: int
    sha256: str
    backend: object  # tokenizers.Tokenizer

    @classmethod
    def load(cls, path: str, eos: str | None = None) -> Tokenizer:
        """A tokenizer folder (``tokenizer.json``, as ``tokenizers`` and transformers save it);
        its EOS token from ``tokenizer_config.json``, else ``eos``, else refused."""
        folder = Path(path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            raise UsageError(f"--tokenizer {path}: no tokenizer.json there")
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(file))
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        if eos is None:
            eos = _configured_eos(file.parent)
        eos_id = backend.token_to_id(eos) if eos is not None else None
        if eos_id is None:
            why = f"has no token {eos!r}" if eos is not None else "names no EOS token"
            raise UsageError(
                f"--tokenizer {path} {why}: give --eos TOKEN (a token of its vocabulary that "
                "ends a document)"
            )
        return cls(file.parent, vocab_size, eos_id, tokenizer_hash(file.parent), backend)

    def encode(self, documents: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(documents)]


def _configured_eos(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos:
                return eos
    return None


def tokenizer_hash(folder: Path) -> str:
    """sha256 of the tokenizer's files (name and contents, in a fixed order)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = folder / name
        if file.is_file():
            h.update(name.encode() + b"\0" + file.read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------- prepare
def _documents(files: list[str], field: str) -> Iterator[tuple[str, int]]:
    """(document, bytes of input it stands for): a text file is one document; a JSON-lines
    file one per line; a parquet file one per row."""
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"--input {name}: no such file")
        if path.suffix in (".jsonl", ".json", ".ndjson"):
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield _field(json.loads(line), field, f"{name}:{number}"), len(line)
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, field)
        else:
            yield path.read_text(encoding="utf-8"), path.stat().st_size


def _field(record: dict, field: str, where: str) -> str:
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise UsageError(f"{where}: no text field {field!r} (choose another with --field)")
    return value


def _parquet_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(
            f"--input {path}: reading parquet needs pyarrow: pip install 'fsdp2lab[data]'"
        ) from None
    file = pq.ParquetFile(path)
    if field not in file.schema_arrow.names:
        raise UsageError(f"{path}: no column {field!r} (choose another with --field)")
    per_row = path.stat().st_size / max(file.metadata.num_rows, 1)
    for batch in file.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            yield text or "", int(per_row)


def prepare(
    tokenizer: Tokenizer,
    inputs: list[str],
    out: str,
    *,
    field: str = "text",
    val_fraction: float = 0.01,
    progress: bool = True,
) -> dict:
    """Tokenize ``inputs`` into ``out`` (see the module docstring); returns the header."""
    from tqdm import tqdm

    if not 0 <= val_fraction < 1:
        raise UsageError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    total_bytes = sum(Path(f).stat().st_size for f in inputs if Path(f).is_file())
    train = folder / "train.bin"
    count = documents = 0
    with (
        open(train, "wb") as f,
        tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        batch: list[str] = []
        size = 0

        def flush() -> None:
            nonlocal count
            for ids in tokenizer.encode(batch):
                ids.append(tokenizer.eos_id)
                np.asarray(ids, dtype=dtype).tofile(f)
                count += len(ids)
            bar.update(size)

        for text, nbytes in _documents(inputs, field):
            batch.append(text)
            size += nbytes
            documents += 1
            if len(batch) == DOCUMENTS_PER_BATCH:
                flush()
                batch, size = [], 0
        flush()
    n_val = int(count * val_fraction)
    _split_tail(train, folder / "val.bin", n_val * np.dtype(dtype).itemsize)
    header = {
        "format": FORMAT,
        "tokenizer": str(tokenizer.path.resolve()),
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": np.dtype(dtype).name,
        "documents": documents,
        "train_tokens": count - n_val,
        "val_tokens": n_val,
    }
    (folder / HEADER).write_text(json.dumps(header, indent=2) + "\n")
    return header


def _split_tail(src: Path, dst: Path, nbytes: int) -> None:
    """Move the last ``nbytes`` of ``src`` into ``dst`` (a copy in blocks, then a truncate)."""
    size = src.stat().st_size
    with open(src, "rb") as f, open(dst, "wb") as g:
        f.seek(size - nbytes)
        while block := f.read(1 << 24):
            g.write(block)
    os.truncate(src, size - nbytes)


# ---------------------------------------------------------------------------- training windows
def read_header(folder: str) -> dict:
    file = Path(folder) / HEADER
    if not file.is_file():
        raise UsageError(
            f"--dataset tokens:{folder}: no {HEADER} there (make one with `fsdp2lab data prepare`)"
        )
    header = json.loads(file.read_text())
    if header.get("format") != FORMAT:
        raise UsageError(f"--dataset tokens:{folder}: {file} is not a token file header")
    return header


def check(folder: str, vocab_size: int, seq_len: int, tokenizer: str | None) -> dict:
    """The header of ``tokens:DIR``, checked against the model and ``--tokenizer`` (before any
    worker starts)."""
    header = read_header(folder)
    where = f"--dataset tokens:{folder}"
    if header["vocab_size"] > vocab_size:
        raise UsageError(
            f"{where}: its tokenizer's vocabulary ({header['vocab_size']:,} tokens) is larger "
            f"than the model's embedding ({vocab_size:,})"
        )
    if tokenizer is not None:
        mine = tokenizer_hash(
            Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
        )
        if mine != header["tokenizer_sha256"]:
            raise UsageError(
                f"{where} was made with another tokenizer ({header['tokenizer']}) than "
                f"--tokenizer {tokenizer} (their files' hashes differ)"
            )
    for split in ("train", "val"):
        if header[f"{split}_tokens"] < seq_len + 1:
            raise UsageError(
                f"{where}: {split}.bin holds {header[f'{split}_tokens']} tokens, fewer than one "
                f"window of --seq-len {seq_len} + 1 (a larger corpus, or --val-fraction)"
            )
    return header


class TokenWindows(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` tokens of a memory-mapped token file: window ``i`` starts at
    token ``i * seq_len``; (input, target) are its first and last ``seq_len`` tokens."""

    def __init__(self, file: Path, dtype: str, seq_len: int):
        self.tokens = np.memmap(file, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.count = (len(self.tokens) - 1) // seq_len
        self.order = WindowOrder  # the sampler's epoch order (a bijection, not a permutation)

    def __len__(self) -> int:
        return self.count

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        windows = self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int64)
        seq = torch.from_numpy(windows)
        return seq[:, :-1], seq[:, 1:]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]


def load(folder: str, seq_len: int) -> tuple[TokenWindows, TokenWindows]:
    header = read_header(folder)
    return tuple(
        TokenWindows(Path(folder) / f"{split}.bin", header["dtype"], seq_len)
        for split in ("train", "val")
    )


# ---------------------------------------------------------------------------- the order
_MASK64 = (1 << 64) - 1
ROUNDS = 4


class WindowOrder:
    """A seeded bijection of ``range(n)`` computed per index (``order[a:b]``), never materialised:
    a 4-round Feistel network on the smallest even number of bits that covers ``n``, with cycle
    walking (an index that lands outside ``range(n)`` is permuted again until it is inside).
    Takes ``(n, seed, epoch)`` as :func:`~fsdp2lab.data.sampler.epoch_order` does."""

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        self.half = (bits + 1) // 2
        digest = hashlib.sha256(f"window-order:{seed}:{epoch}".encode()).digest()
        self.keys = [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(ROUNDS)]

    def __len__(self) -> int:
        return self.n

    def _round(self, right: np.ndarray, key: int) -> np.ndarray:
        x = (right ^ np.uint64(key)) * np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
        return x & np.uint64((1 << self.half) - 1)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> np.uint64(self.half), x & mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << np.uint64(self.half)) | right

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, step = index.indices(self.n)
        x = np.arange(start, stop, step, dtype=np.uint64)
        with np.errstate(over="ignore"):
            x = self._permute(x)
            outside = x >= np.uint64(self.n)
            while outside.any():
                x[outside] = self._permute(x[outside])
                outside = x >= np.uint64(self.n)
        return torch.from_numpy(x.astype(np.int64))
