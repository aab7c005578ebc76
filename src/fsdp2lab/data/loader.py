"""Resolve ``--dataset``, load it (rank 0 downloads while the others wait), and build the loaders."""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from fsdp2lab.config import TrainConfig, is_reference
from fsdp2lab.data import sources, synthetic, text, token_windows, tokens, user
from fsdp2lab.data.arrays import ArrayDataset, collate_batch
from fsdp2lab.data.sampler import DistributedBatchSampler
from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec
from fsdp2lab.models.user import load_object

DOWNLOAD_TIMEOUT_S = 30
# torchdata's StatefulDataLoader calls a torch API that torch has since deprecated; not ours to fix.
warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")


@dataclass
class DataChoice:
    name: str
    folder: str | None  # None for generated data
    note: str  # what is used and why, for the user


def choose(cfg: TrainConfig, spec: ModelSpec) -> DataChoice:
    """Decide which dataset to use, downloading if needed. Run on one rank only."""
    if is_reference("dataset", cfg.dataset):
        # refused here, before workers start: os:system
        load_object(cfg.dataset, "--dataset", "dataset")
        return DataChoice(cfg.dataset, None, f"{cfg.dataset} (your dataset)")
    if tokens.is_tokens(cfg.dataset):
        folder = cfg.dataset.removeprefix(tokens.PREFIX)
        return DataChoice("tokens", folder, f"token windows of {folder} (memory-mapped)")
    name = spec.default_dataset if cfg.dataset == "auto" else cfg.dataset
    if cfg.dataset == "auto" and spec.task == "lm":
        name = "text" if cfg.text_file else "synthetic"
    if name not in spec.datasets:
        raise UsageError(
            f"dataset {name!r} does not fit model {spec.name!r}; it takes: {', '.join(spec.datasets)}"
        )
    if name == "synthetic":
        return DataChoice(name, None, "synthetic data generated from the seed (no download)")
    if name == "text":
        return DataChoice(name, cfg.text_file, f"bytes of {cfg.text_file}")
    if cfg.dataset != "auto":
        folder = _ensure(name, cfg)
        return DataChoice(name, str(folder), f"{name} from {folder}")
    try:
        folder = _ensure(name, cfg)
        return DataChoice(name, str(folder), f"{name} from {folder}")
    except UsageError as e:
        why = str(e).splitlines()[0].split(": ", 1)[-1].rstrip(".")
    for fallback in [d for d in spec.datasets if d not in (name, "synthetic")]:
        folder = sources.locate(fallback, cfg.data_dir)
        if folder is not None:
            return DataChoice(
                fallback,
                str(folder),
                f"{fallback} from {folder}, because {name} is not available ({why})",
            )
    return DataChoice(
        "synthetic",
        None,
        f"synthetic data generated from the seed, because {name} is not available ({why})",
    )


def _ensure(name: str, cfg: TrainConfig):
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        return sources.ensure(name, cfg.data_dir, cfg.download)
    finally:
        socket.setdefaulttimeout(previous)


def load(
    choice: DataChoice, cfg: TrainConfig, spec: ModelSpec
) -> tuple[ArrayDataset, ArrayDataset]:
    if is_reference("dataset", choice.name):
        return user.load(choice.name)
    if choice.name == "synthetic":
        n_test = max(1, cfg.synthetic_size // 4)
        if spec.task == "lm":
            return synthetic.tokens(
                cfg.vocab_size, cfg.seq_len, cfg.synthetic_size, n_test, cfg.seed
            )
        return synthetic.images(
            spec.input_shape, cfg.synthetic_size, n_test, cfg.seed, classes=spec.num_classes or 10
        )
    if choice.name == "tokens":
        return token_windows.load(choice.folder, cfg.seq_len)
    if choice.name == "text":
        if cfg.vocab_size < 256:
            raise UsageError(
                f"--dataset text is byte-level: --vocab-size must be >= 256, got {cfg.vocab_size}"
            )
        return text.byte_windows(choice.folder, cfg.seq_len)
    from pathlib import Path

    return sources.load(choice.name, Path(choice.folder))


def sampler_order(dataset) -> dict:
    """The dataset's own epoch order where it has one (token files: a bijection per index)."""
    order = getattr(dataset, "order", None)
    return {"order": order} if order is not None else {}


def train_loader(
    dataset: ArrayDataset, sampler: DistributedBatchSampler, cfg: TrainConfig, device: torch.device
):
    return StatefulDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_batch,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
    )
