"""Your own data: ``--dataset pkg.module:NAME`` or ``--dataset path/file.py:NAME``.

``NAME()`` returns ``(train, test)``: map-style datasets (``len`` and ``[i]``) of ``(input, target)``
pairs, e.g. torchvision datasets with a ``ToTensor`` transform. They are read once into tensors
(:class:`~fsdp2lab.data.arrays.ArrayDataset`), so every rank samples them with the same
world-size-independent order as the built-in datasets; they must fit in memory.
"""

from __future__ import annotations

import torch

from fsdp2lab.data.arrays import ArrayDataset
from fsdp2lab.errors import UsageError
from fsdp2lab.models.user import load_object


def load(reference: str) -> tuple[ArrayDataset, ArrayDataset]:
    factory = load_object(reference, "--dataset", "dataset")
    try:
        made = factory()
    except Exception as e:  # the user's code
        raise UsageError(f"--dataset {reference}: {type(e).__name__}: {e}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise UsageError(
            f"--dataset {reference} returned {type(made).__name__}: expected (train, test) datasets"
        )
    return _tensors(made[0], reference, "train"), _tensors(made[1], reference, "test")


def _tensors(dataset, reference: str, split: str) -> ArrayDataset:
    where = f"--dataset {reference}: the {split} set"
    try:
        n = len(dataset)
        items = [dataset[i] for i in range(n)]
    except Exception as e:
        raise UsageError(f"{where} is not a map-style dataset ({type(e).__name__}: {e})") from None
    if n == 0:
        raise UsageError(f"{where} is empty")
    inputs, targets = [], []
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise UsageError(f"{where}: item {i} is {type(item).__name__}, not (input, target)")
        x, y = torch.as_tensor(item[0]), torch.as_tensor(item[1])
        if inputs and (x.shape != inputs[0].shape or y.shape != targets[0].shape):
            raise UsageError(
                f"{where}: item {i} has input {tuple(x.shape)} and target {tuple(y.shape)}, "
                f"item 0 has {tuple(inputs[0].shape)} and {tuple(targets[0].shape)}"
            )
        inputs.append(x)
        targets.append(y)
    y = torch.stack(targets)
    if y.is_floating_point():
        raise UsageError(f"{where}: targets are {y.dtype}; cross-entropy needs class indices")
    return ArrayDataset(torch.stack(inputs), y.long())
