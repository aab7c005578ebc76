"""The seeds' MLPs: ``SimpleNN`` (784-128-64-10) and the 2-layer MLP of the parallelism walk-through.

Both are sharded per linear layer and have a TP plan; a pipeline stage skips the layers another
stage holds (``fc`` is a ``Sequential``: a stage deletes the others' entries, keeping the names).
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fsdp2lab.models.spec import ModelSpec

IMAGE_28 = ("mnist", "fashion-mnist", "synthetic")


class SimpleNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Sequential(
            nn.Linear(28 * 28, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flatten is not None:
            x = self.flatten(x)
        return self.fc(x)


# TP: fc.0 column-wise, fc.2 row-wise with a reduce-scatter that leaves its 64 outputs split,
# fc.4 row-wise again (all-reduce of the logits).
def simple_nn_tp(model: SimpleNN) -> dict:
    return {
        "fc.0": ColwiseParallel(),
        "fc.2": RowwiseParallel(output_layouts=Shard(-1)),
        "fc.4": RowwiseParallel(input_layouts=Shard(-1)),
    }


SIMPLE_NN = ModelSpec(
    name="mlp",
    build=lambda cfg: SimpleNN(),
    task="classify",
    input_shape=(1, 28, 28),
    datasets=IMAGE_28,
    default_dataset="mnist",
    units=lambda model: ["fc.0", "fc.2", "fc.4"],
    tp_plan=simple_nn_tp,
    tp_sizes=lambda model: {"mlp hidden width fc.0": 128, "fc.2": 64},
    pipeline=lambda model: ["flatten", "fc.0", "fc.1", "fc.2", "fc.3", "fc.4"],
    num_classes=10,
)


class MLP2(nn.Module):
    """Two linear layers: ``net1`` (784 -> hidden) splits by columns, ``net2`` (hidden -> 10) by rows under TP."""

    def __init__(self, hidden: int = 512):
        super().__init__()
        self.net1 = nn.Linear(28 * 28, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.net1 is not None:
            x = self.relu(self.net1(torch.flatten(x, 1)))
        if self.net2 is not None:
            x = self.net2(x)
        return x


MLP2_SPEC = ModelSpec(
    name="mlp2",
    build=lambda cfg: MLP2(),
    task="classify",
    input_shape=(1, 28, 28),
    datasets=IMAGE_28,
    default_dataset="mnist",
    units=lambda model: ["net1", "net2"],
    # The Megatron MLP: hidden units split, then an all-reduce of the logits.
    tp_plan=lambda model: {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
    tp_sizes=lambda model: {"mlp2 hidden width": model.net1.out_features},
    pipeline=lambda model: ["net1", "relu", "net2"],
    num_classes=10,
)
