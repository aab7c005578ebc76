"""An in-memory dataset whose batches are one tensor index (no per-sample Python work)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class ArrayDataset(Dataset):
    """Inputs and targets as tensors; uint8 images are normalised per batch with (mean, std) per channel."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, mean=None, std=None):
        assert len(inputs) == len(targets)
        self.inputs = inputs
        self.targets = targets
        shape = (1, -1) + (1,) * (inputs.dim() - 2)
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(shape)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(shape)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self.inputs[idx]
        if x.dtype == torch.uint8:
            x = x.to(torch.float32).div_(255.0)
            if self.mean is not None:
                x = x.sub_(self.mean).div_(self.std)
        return x, self.targets[idx]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]


def collate_batch(batch):
    """The dataset already returns a batch: the loader passes it through."""
    return batch
