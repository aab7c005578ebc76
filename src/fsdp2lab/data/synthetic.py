"""Learnable synthetic data made from the seed: no download, any input shape.

Images: each class has a random prototype image; a sample is its class's prototype plus Gaussian
noise, so a model can learn it (unlike pure noise). Tokens: a fixed random Markov chain in which each
token is followed by its successor with probability 0.9, so next-token accuracy can approach 90%.
"""

from __future__ import annotations

import torch

from fsdp2lab.data.arrays import ArrayDataset

DATA_SEED_OFFSET = 1_000_003


def images(
    shape: tuple[int, ...],
    n_train: int,
    n_test: int,
    seed: int,
    classes: int = 10,
    noise: float = 3.0,
):
    g = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)
    prototypes = torch.randn((classes, *shape), generator=g)

    def make(n: int) -> ArrayDataset:
        y = torch.randint(0, classes, (n,), generator=g)
        x = prototypes[y] + noise * torch.randn((n, *shape), generator=g)
        return ArrayDataset(x / (1.0 + noise), y)

    return make(n_train), make(n_test)


def tokens(vocab: int, seq_len: int, n_train: int, n_test: int, seed: int, p_follow: float = 0.9):
    g = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)
    successor = torch.randperm(vocab, generator=g)

    def make(n: int) -> ArrayDataset:
        seq = torch.empty((n, seq_len + 1), dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(seq_len):
            follow = torch.rand(n, generator=g) < p_follow
            random_next = torch.randint(0, vocab, (n,), generator=g)
            seq[:, t + 1] = torch.where(follow, successor[seq[:, t]], random_next)
        return ArrayDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    return make(n_train), make(n_test)
