"""Your tokenizer, your text: a flat token file, and its checks (numpy, no torch: ``fsdp2lab data
prepare`` stays light).

``fsdp2lab data prepare`` tokenizes text files (one document each), JSON lines (a ``text`` field,
or ``--field``) and parquet files (the same field; the ``data`` extra brings pyarrow) once, with
an EOS token after every document, into ``DIR/train.bin`` and ``DIR/val.bin`` (uint16, or uint32
for vocabularies above 65,536) and a small header ``DIR/tokens.json``: the tokenizer, a hash of
its files, its vocabulary size, the EOS id, the largest token id and the token counts. The last
``--val-fraction`` of the tokens is written apart as ``val.bin``: what evaluation reads. The files
are written under temporary names and renamed into place, the header last: a prepare that fails
leaves the folder as it was. A document longer than :data:`PIECE_CHARS` characters is encoded in
pieces cut just before a space (:func:`pieces`), so memory stays bounded whatever its length.

``--dataset tokens:DIR`` checks the header and files here (:func:`check`) and trains on their
windows (:mod:`fsdp2lab.data.token_windows`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
DTYPES = ("uint16", "uint32")
# A longer document is encoded in pieces of about this many characters (tokenizers needs ~175
# bytes per character of one encode call); a batch holds about BATCH_CHARS characters.
PIECE_CHARS = 1 << 16
BATCH_CHARS = 1 << 18
MIN_WINDOW = 2  # tokens of the smallest window (--seq-len 1): an input and its target
SCAN_TOKENS = 1 << 24  # tokens read at a time when a header lacks the largest id


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
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:
            raise UsageError(
                "data prepare needs the tokenizers package: pip install 'fsdp2lab[hf]'"
            ) from None
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise UsageError(f"--tokenizer {path}: {file} cannot be read: {_first(e)}") from None
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

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Each text's ids; ``special``: with the special tokens the tokenizer adds (a BOS)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=special)]

    def special_ends(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text (a BOS, say)."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a").ids
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return full[:i], full[i + len(plain) :]
        return [], []


def _first(e: BaseException) -> str:
    """An exception's first line (its type when it has no message)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _json_file(file: Path) -> object:
    """A JSON file's value; a file that is not JSON is one line naming it."""
    try:
        return json.loads(file.read_bytes())
    except UnicodeDecodeError as e:
        raise UsageError(f"{file}: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{file}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None


def _configured_eos(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        if file.is_file():
            config = _json_file(file)
            eos = config.get("eos_token") if isinstance(config, dict) else None
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
    file one per line; a parquet file one per row. Bad input is one line naming the file (and
    the line)."""
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"--input {name}: no such file")
        if path.suffix in (".jsonl", ".json", ".ndjson"):
            with path.open("rb") as f:
                for number, raw in enumerate(f, 1):
                    where, size = f"{name}:{number}", len(raw)
                    line = _decode(raw, where)
                    del raw  # a long line is held once, as its text, while it is encoded
                    if line and not line.isspace():
                        text = _field(_json_line(line, where), field, where)
                        del line
                        yield text, size
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, field)
        else:
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                raise UsageError(f"{name}:{line}: not UTF-8 text (byte {e.start:,})") from None
            size, data = len(data), None  # not held while the text is encoded
            yield text, size


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not UTF-8 text (byte {e.start:,} of the line)") from None


def _json_line(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:  # past the line's end: at its last column + 1
        column = e.colno if e.lineno == 1 else len(line.rstrip("\r\n")) + 1
        raise UsageError(f"{where}: not a JSON line ({e.msg}, column {column})") from None


def _field(record: dict, field: str, where: str) -> str:
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise UsageError(f"{where}: no text field {field!r} (choose another with --field)")
    return value


def _parquet_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(
            f"--input {path}: reading parquet needs pyarrow: pip install 'fsdp2lab[data]'"
        ) from None
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"--input {path}: not a parquet file ({_first(e)})") from None
    if field not in file.schema_arrow.names:
        raise UsageError(f"{path}: no column {field!r} (choose another with --field)")
    kind = file.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UsageError(
            f"{path}: column {field!r} holds {kind}, not text (choose another with --field)"
        )
    per_row = path.stat().st_size / max(file.metadata.num_rows, 1)
    for batch in file.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            yield text or "", int(per_row)


_BORDER = re.compile(r"\S(?= )")  # a non-space character followed by a space: where a cut goes


def pieces(text: str, size: int | None = None) -> Iterator[str]:
    """``text`` cut into pieces of at most ``size`` (default :data:`PIECE_CHARS`) characters,
    each cut just before a space that follows a non-space character (a piece of ``size``
    characters without one is cut at ``size``). Pre-tokenizers that start a word at a space (byte-level BPE as GPT-2, Llama 3
    and Qwen use it; Metaspace; whitespace splitting) give the same pre-tokens for the pieces as
    for the whole text, so the pieces' tokens are the whole text's."""
    size = size or PIECE_CHARS
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = None
        for m in _BORDER.finditer(text, max(start, end - 4096), end):
            cut = m.end()
        if cut is None:
            for m in _BORDER.finditer(text, start, end):
                cut = m.end()
        cut = cut if cut is not None and cut > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


class _Writer:
    """Encodes documents in batches of about :data:`BATCH_CHARS` characters into a token file;
    a document longer than :data:`PIECE_CHARS` is encoded in :func:`pieces`, the tokenizer's
    special tokens (a BOS) put once around the whole, as for a short document."""

    def __init__(self, tokenizer: Tokenizer, file, dtype: np.dtype, bar):
        self.tokenizer, self.file, self.dtype, self.bar = tokenizer, file, dtype, bar
        self.ends = tokenizer.special_ends()
        self.batch: list[tuple[str, list[int], list[int], bool]] = []
        self.chars = self.nbytes = 0
        self.count = self.max_id = 0

    def add(self, text: str, nbytes: int) -> None:
        eos = [self.tokenizer.eos_id]
        if len(text) <= PIECE_CHARS:
            self._put(text, [], eos, True)
        else:
            before, after = self.ends
            parts = pieces(text)
            part = next(parts)
            for following in parts:  # each piece put once the next one is known
                self._put(part, before, [], False)
                part, before = following, []
            self._put(part, before, [*after, *eos], False)
        self.nbytes += nbytes
        if len(self.batch) >= DOCUMENTS_PER_BATCH:
            self.flush()

    def _put(self, text: str, before: list[int], after: list[int], special: bool) -> None:
        self.batch.append((text, before, after, special))
        self.chars += len(text)
        if self.chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        encoded: dict[bool, Iterator[list[int]]] = {}
        for special in (True, False):
            texts = [t for t, _, _, s in self.batch if s is special]
            encoded[special] = iter(self.tokenizer.encode(texts, special) if texts else [])
        for _, before, after, special in self.batch:
            ids = np.asarray([*before, *next(encoded[special]), *after], dtype=self.dtype)
            self.file.write(ids.data)  # an OSError with its errno, unlike ndarray.tofile
            self.count += len(ids)
            if len(ids):
                self.max_id = max(self.max_id, int(ids.max()))
        self.bar.update(self.nbytes)
        self.batch, self.chars, self.nbytes = [], 0, 0


def prepare(
    tokenizer: Tokenizer,
    inputs: list[str],
    out: str,
    *,
    field: str = "text",
    val_fraction: float = 0.01,
    progress: bool = True,
) -> dict:
    """Tokenize ``inputs`` into ``out`` (see the module docstring); returns the header. Nothing
    in ``out`` changes unless every input was read and both splits hold a window."""
    from tqdm import tqdm

    if not 0 < val_fraction < 1:
        raise UsageError(
            f"--val-fraction must be in (0, 1), got {val_fraction} (val.bin, the held-out "
            "tokens, is what evaluation reads)"
        )
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    total_bytes = sum(Path(f).stat().st_size for f in inputs if Path(f).is_file())
    names = ("train.bin", "val.bin", HEADER)
    temporary = {name: folder / f".{name}.{os.getpid()}.tmp" for name in names}
    try:
        with (
            open(temporary["train.bin"], "wb") as f,
            tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress) as bar,
        ):
            writer = _Writer(tokenizer, f, dtype, bar)
            documents = 0
            for text, nbytes in _documents(inputs, field):
                writer.add(text, nbytes)
                documents += 1
            writer.flush()
            f.flush()
            os.fsync(f.fileno())
        count = writer.count
        n_val = int(count * val_fraction)
        for split, n in (("train", count - n_val), ("val", n_val)):
            if n < MIN_WINDOW:
                raise UsageError(
                    f"--input {' '.join(inputs)}: its {count:,} tokens leave {n:,} for "
                    f"{split}.bin, fewer than one window ({MIN_WINDOW} tokens at --seq-len 1): "
                    "a larger corpus, or another --val-fraction"
                )
        _split_tail(temporary["train.bin"], temporary["val.bin"], n_val * dtype.itemsize)
        header = {
            "format": FORMAT,
            "tokenizer": str(tokenizer.path.resolve()),
            "tokenizer_sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "dtype": dtype.name,
            "max_token_id": writer.max_id,
            "documents": documents,
            "train_tokens": count - n_val,
            "val_tokens": n_val,
        }
        temporary[HEADER].write_text(json.dumps(header, indent=2) + "\n")
        # The old header goes first and the new one comes last: a folder whose renames were cut
        # short has no header, and is refused as unprepared.
        (folder / HEADER).unlink(missing_ok=True)
        for name in names:
            os.replace(temporary[name], folder / name)
    except OSError as e:  # a full or read-only disk, an unreadable input
        where = Path(e.filename) if e.filename else folder
        action = "write the token file" if folder in (where, *where.parents) else "read the input"
        raise UsageError(
            f"--out {out}: cannot {action} ({where}: {e.strerror}); nothing in {out} changed"
        ) from e
    finally:
        for file in temporary.values():
            file.unlink(missing_ok=True)
        if created and not any(folder.iterdir()):
            folder.rmdir()
    return header


def _split_tail(src: Path, dst: Path, nbytes: int) -> None:
    """Move the last ``nbytes`` of ``src`` into ``dst`` (a copy in blocks, then a truncate)."""
    size = src.stat().st_size
    with open(src, "rb") as f, open(dst, "wb") as g:
        f.seek(size - nbytes)
        while block := f.read(1 << 24):
            g.write(block)
        g.flush()
        os.fsync(g.fileno())
    os.truncate(src, size - nbytes)


# ---------------------------------------------------------------------------- the header and its checks
def read_header(folder: str) -> dict:
    file = Path(folder) / HEADER
    if not file.is_file():
        raise UsageError(
            f"--dataset tokens:{folder}: no {HEADER} there (make one with `fsdp2lab data prepare`)"
        )
    header = _json_file(file)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise UsageError(f"--dataset tokens:{folder}: {file} is not a token file header")
    return header


def check_files(folder: str) -> dict:
    """The header of ``tokens:DIR`` and its files, checked against each other: the dtype, the
    counts, each file's size. Returns the header."""
    header = read_header(folder)
    file = Path(folder) / HEADER
    if header.get("dtype") not in DTYPES:
        raise UsageError(
            f"{file}: dtype {header.get('dtype')!r}; token files are {' or '.join(DTYPES)}"
        )
    for key in ("vocab_size", "eos_id", "train_tokens", "val_tokens", "max_token_id"):
        value = header.get(key)
        if key == "max_token_id" and value is None:
            continue  # a header written before the largest id was recorded
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"{file}: {key} is {value!r}, not a count")
    itemsize = np.dtype(header["dtype"]).itemsize
    for split in ("train", "val"):
        data = Path(folder) / f"{split}.bin"
        n = header[f"{split}_tokens"]
        if not data.is_file():
            raise UsageError(
                f"{data}: missing ({HEADER} counts {n:,} tokens in it); make the folder again "
                "with `fsdp2lab data prepare`"
            )
        size = data.stat().st_size
        if size != n * itemsize:
            raise UsageError(
                f"{data}: {size:,} bytes, but {HEADER} gives {n:,} {header['dtype']} tokens "
                f"({n * itemsize:,} bytes): an unfinished or altered file; make the folder "
                "again with `fsdp2lab data prepare`"
            )
    return header


def largest_id(folder: str, header: dict) -> int:
    """The largest token id in the folder's files (checked by :func:`check_files`), read once
    in blocks of :data:`SCAN_TOKENS`: for a header without ``max_token_id``."""
    largest = 0
    for split in ("train", "val"):
        if header[f"{split}_tokens"] == 0:
            continue  # numpy cannot map an empty file
        ids = np.memmap(Path(folder) / f"{split}.bin", dtype=np.dtype(header["dtype"]), mode="r")
        for start in range(0, len(ids), SCAN_TOKENS):
            largest = max(largest, int(ids[start : start + SCAN_TOKENS].max()))
    return largest


def check(folder: str, vocab_size: int, seq_len: int, tokenizer: str | None) -> dict:
    """The header of ``tokens:DIR`` and its files (:func:`check_files`), checked against the
    model's vocabulary (the header's ``max_token_id``; without one, the files' largest id),
    ``--seq-len`` and ``--tokenizer``, before any worker starts: no id past the vocabulary
    reaches a device."""
    header = check_files(folder)
    where = f"--dataset tokens:{folder}"
    largest, read = header.get("max_token_id"), ""
    if largest is None and header["vocab_size"] > vocab_size:
        raise UsageError(
            f"{where}: its tokenizer's vocabulary ({header['vocab_size']:,} tokens) is larger "
            f"than the model's embedding ({vocab_size:,})"
        )
    if largest is None:  # a header written before the largest id was recorded: the files say
        largest, read = largest_id(folder, header), f" (read from its files: {HEADER} has none)"
    if largest >= vocab_size:
        raise UsageError(
            f"{where}: its largest token id is {largest:,}{read}, beyond the model's vocabulary "
            f"({vocab_size:,} tokens: ids 0 to {vocab_size - 1:,})"
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
