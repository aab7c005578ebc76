"""``--dataset tokens:DIR`` (a token file of ``fsdp2lab data prepare``, :mod:`fsdp2lab.data.tokens`)
trains on windows of ``--seq-len + 1`` tokens (consecutive windows share
one token, so every token is a target once) read from the memory map, never loading the file: a
rank's memory does not grow with the corpus. The epoch's order is a seeded bijection of the window
indices computed per index (:class:`WindowOrder`), never a materialised permutation, and is the
same at every world size, so a run resumes exactly on another number of ranks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from fsdp2lab.data.tokens import read_header


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
