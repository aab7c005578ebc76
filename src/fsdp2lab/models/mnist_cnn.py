"""The seed tutorial's MNIST ``Net``: two convolutions, dropout, two linear layers, log-softmax.

Sharded per layer; no TP plan; a pipeline stage skips the layers another stage holds.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2lab.models.spec import ModelSpec


class Net(nn.Module):
    def __init__(self, dropout1: float = 0.25, dropout2: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(dropout1)
        self.dropout2 = nn.Dropout(dropout2)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv1 is not None:
            x = F.relu(self.conv1(x))
        if self.conv2 is not None:
            x = F.relu(self.conv2(x))
            x = F.max_pool2d(x, 2)
            x = self.dropout1(x)
            x = torch.flatten(x, 1)
        if self.fc1 is not None:
            x = F.relu(self.fc1(x))
            x = self.dropout2(x)
        if self.fc2 is not None:
            x = self.fc2(x)
            x = F.log_softmax(x, dim=1)
        return x


def build(cfg) -> Net:
    return Net(cfg.dropout_or(0.25), cfg.dropout_or(0.5))


LAYERS = ["conv1", "conv2", "fc1", "fc2"]
# The main job's recipe (``--recipe tuned``): above 90% Fashion-MNIST test accuracy after epoch 1
# on 2 ranks (tests/test_real_data.py; the table and its command: docs/speed.md). ``--recipe
# seed`` trains as the seed tutorial does (global batch 64).
TUNED = {"optimizer": "adam", "lr": 2e-3, "dropout": 0.0, "global_batch_size": 128}
SPEC = ModelSpec(
    name="cnn",
    build=build,
    task="classify",
    input_shape=(1, 28, 28),
    datasets=("mnist", "fashion-mnist", "synthetic"),
    default_dataset="mnist",
    units=lambda model: LAYERS,
    pipeline=lambda model: LAYERS,
    num_classes=10,
    recipes={"mnist": TUNED, "fashion-mnist": TUNED},
)
