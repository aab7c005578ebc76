"""World-size-independent distributed sampling.

Each epoch has one global order, a permutation seeded by (seed, epoch) (or the dataset's own
order, e.g. a bijection computed per index for a corpus too large to permute). Optimizer step ``s`` takes
the global batch ``order[s*G : (s+1)*G]``; gradient accumulation cuts it into K micro-batches, and
data-parallel rank ``r`` takes its contiguous slice of each. So every sample is seen once per epoch,
the ranks' shares are disjoint, and a position counted in global samples means the same thing at any
world size: the basis of exact resume on another number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Sampler

from fsdp2lab.errors import UsageError

ORDER_SEED_OFFSET = 7919


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch + ORDER_SEED_OFFSET)
    return torch.randperm(num_samples, generator=g)


class DistributedBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of indices; stateful in global samples."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        grad_accum: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        order: Callable[[int, int, int], Any] = epoch_order,
    ):
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_global = global_batch // grad_accum
        self.per_rank = self.micro_global // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.order = order  # (samples, seed, epoch) -> the epoch's order, sliceable
        self.steps_per_epoch = num_samples // global_batch
        self.grad_accum = grad_accum
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"the global batch ({global_batch}) is larger than the training set ({num_samples} samples)"
            )
        self.epoch = 0
        self.start_sample = 0  # global samples of this epoch already consumed when iteration starts

    def __len__(self) -> int:
        return self.steps_per_epoch * self.grad_accum - self.start_sample // self.micro_global

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        if start_sample % self.micro_global:
            raise ValueError(
                f"position {start_sample} is not on a micro-batch boundary ({self.micro_global})"
            )
        self.epoch, self.start_sample = epoch, start_sample

    def __iter__(self):
        order = self.order(self.num_samples, self.seed, self.epoch)
        first = self.start_sample // self.micro_global
        for micro in range(first, self.steps_per_epoch * self.grad_accum):
            base = micro * self.micro_global + self.dp_rank * self.per_rank
            yield order[base : base + self.per_rank].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start_sample": self.start_sample}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(state["epoch"], state["start_sample"])


def eval_shards(
    num_samples: int, batch: int, dp_size: int, dp_rank: int
) -> list[tuple[list[int], int]]:
    """This rank's evaluation batches as (indices, number valid).

    Every rank runs the same number of batches (sharded models need all ranks in each forward); the
    shorter shares are padded with repeated indices that are masked out of the metrics.
    """
    share = -(-num_samples // dp_size)
    lo = min(dp_rank * share, num_samples)
    hi = min(lo + share, num_samples)
    mine = list(range(lo, hi))
    batches = []
    for start in range(0, share, batch):
        idx = mine[start : start + batch]
        size = min(batch, share - start)
        valid = len(idx)
        idx = idx + [0] * (size - valid)
        batches.append((idx, valid))
    return batches
