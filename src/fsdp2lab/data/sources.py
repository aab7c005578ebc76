"""Real datasets: find them on disk, download them with torchvision (rank 0 only), load them as tensors.

MNIST and Fashion-MNIST are read from their IDX files (``.gz`` or not) in torchvision's layout
``DATA_DIR/<MNIST|FashionMNIST>/raw``; Fashion-MNIST is also found where Debian's package
``dataset-fashion-mnist`` puts it. CIFAR-10 uses torchvision's ``cifar-10-batches-py`` folder.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fsdp2lab.data.arrays import ArrayDataset
from fsdp2lab.errors import UsageError

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR_FILES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
)


@dataclass(frozen=True)
class Source:
    name: str
    folder: str  # under --data-dir, torchvision's layout
    files: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    system_dirs: tuple[Path, ...] = ()


SOURCES = {
    "mnist": Source("mnist", "MNIST/raw", IDX_FILES, (0.1307,), (0.3081,)),
    "fashion-mnist": Source(
        "fashion-mnist",
        "FashionMNIST/raw",
        IDX_FILES,
        (0.2860,),
        (0.3530,),
        (DEBIAN_FASHION_MNIST,),
    ),
    "cifar10": Source(
        "cifar10",
        "cifar-10-batches-py",
        CIFAR_FILES,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
}


def _has(folder: Path, name: str) -> bool:
    return (folder / name).is_file() or (folder / f"{name}.gz").is_file()


def locate(name: str, data_dir: str) -> Path | None:
    """The folder holding every file of dataset ``name``, or None."""
    src = SOURCES[name]
    for folder in (Path(data_dir) / src.folder, *src.system_dirs):
        if all(_has(folder, f) for f in src.files):
            return folder
    return None


def download(name: str, data_dir: str) -> Path:
    """Download with torchvision into ``data_dir``; raise UsageError if that is impossible."""
    from torchvision import datasets

    cls = {
        "mnist": datasets.MNIST,
        "fashion-mnist": datasets.FashionMNIST,
        "cifar10": datasets.CIFAR10,
    }[name]
    try:
        for train in (True, False):
            cls(data_dir, train=train, download=True)
    except Exception as e:  # network errors come in many types; any of them means "not downloaded"
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UsageError(
            missing_message(name, data_dir, f"the download failed ({reason})")
        ) from None
    folder = locate(name, data_dir)
    if folder is None:
        raise UsageError(
            missing_message(name, data_dir, "the download did not produce the expected files")
        )
    return folder


def missing_message(name: str, data_dir: str, why: str) -> str:
    src = SOURCES[name]
    where = [str(Path(data_dir) / src.folder), *map(str, src.system_dirs)]
    return (
        f"dataset {name} is not available: {why}.\n"
        f"  needed files: {', '.join(src.files)}{' (.gz accepted)' if name != 'cifar10' else ''}\n"
        f"  looked in: {' and '.join(where)}\n"
        f"  fix: on a machine with internet run `fsdp2lab data download {name} --data-dir DIR` and copy DIR to "
        f"{data_dir}, pass --data-dir, or train on --dataset synthetic"
    )


def ensure(name: str, data_dir: str, allow_download: bool) -> Path:
    folder = locate(name, data_dir)
    if folder is not None:
        return folder
    if not allow_download:
        raise UsageError(
            missing_message(name, data_dir, "the files are missing and --no-download was given")
        )
    return download(name, data_dir)


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (the MNIST format), gzipped or not."""
    gz = path.with_name(path.name + ".gz")
    opener, target = (open, path) if path.is_file() else (gzip.open, gz)
    with opener(target, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise UsageError(f"{target} is not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise UsageError(
            f"{target} is truncated: expected {int(np.prod(shape))} values, found {array.size}"
        )
    return torch.from_numpy(array.copy()).view(*shape)


def load(name: str, folder: Path) -> tuple[ArrayDataset, ArrayDataset]:
    """Train and test sets as uint8 tensors, normalised per batch."""
    src = SOURCES[name]
    if name == "cifar10":
        from torchvision.datasets import CIFAR10

        root = folder.parent
        sets = [CIFAR10(str(root), train=t, download=False) for t in (True, False)]
        pairs = [
            (torch.from_numpy(s.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(s.targets))
            for s in sets
        ]
    else:
        x_train, y_train, x_test, y_test = (read_idx(folder / f) for f in IDX_FILES)
        pairs = [(x_train.unsqueeze(1), y_train.long()), (x_test.unsqueeze(1), y_test.long())]
    train, test = (ArrayDataset(x, y, src.mean, src.std) for x, y in pairs)
    return train, test
