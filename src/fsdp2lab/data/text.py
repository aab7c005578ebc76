"""A byte-level language-modelling dataset from any text file: windows of ``seq_len + 1`` bytes."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp2lab.data.arrays import ArrayDataset
from fsdp2lab.errors import UsageError


def byte_windows(path: str, seq_len: int, test_fraction: float = 0.1):
    """Non-overlapping windows; the last ``test_fraction`` of the file is the test set."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--text-file {path}: no such file")
    data = torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8).to(torch.long)
    window = seq_len + 1
    n = len(data) // window
    if n < 2:
        raise UsageError(
            f"--text-file {path} has {len(data)} bytes: need at least {2 * window} for --seq-len {seq_len}"
        )
    seq = data[: n * window].view(n, window)
    n_test = max(1, int(n * test_fraction))
    train, test = seq[:-n_test], seq[-n_test:]
    return (
        ArrayDataset(train[:, :-1].contiguous(), train[:, 1:].contiguous()),
        ArrayDataset(test[:, :-1].contiguous(), test[:, 1:].contiguous()),
    )
