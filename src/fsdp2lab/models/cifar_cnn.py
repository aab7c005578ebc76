"""A CNN for 3x32x32 CIFAR-10 images (the scaling exercise's model), any batch size.

Sharded per conv block and linear layer; no TP plan; a pipeline stage skips the others' layers.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2lab.models.spec import ModelSpec


class ConvBlock(nn.Module):
    """conv 3x3 (same padding) -> ReLU -> optional 2x2 max-pool."""

    def __init__(self, cin: int, cout: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        return F.max_pool2d(x, 2) if self.pool else x


class CifarCNN(nn.Module):
    def __init__(self, dropout: float = 0.25, num_classes: int = 10):
        super().__init__()
        self.block1 = ConvBlock(3, 32, pool=False)
        self.block2 = ConvBlock(32, 64, pool=True)  # 16x16
        self.block3 = ConvBlock(64, 128, pool=True)  # 8x8
        self.dropout = nn.Dropout(dropout)
        self.fc1 = nn.Linear(128 * 8 * 8, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in (self.block1, self.block2):
            if block is not None:
                x = block(x)
        if self.block3 is not None:
            x = self.dropout(torch.flatten(self.block3(x), 1))
        if self.fc1 is not None:
            x = self.dropout(F.relu(self.fc1(x)))
        if self.fc2 is not None:
            x = self.fc2(x)
        return x


LAYERS = ["block1", "block2", "block3", "fc1", "fc2"]
SPEC = ModelSpec(
    name="cifar-cnn",
    build=lambda cfg: CifarCNN(cfg.dropout_or(0.25)),
    task="classify",
    input_shape=(3, 32, 32),
    datasets=("cifar10", "synthetic"),
    default_dataset="cifar10",
    units=lambda model: LAYERS,
    pipeline=lambda model: LAYERS,
    num_classes=10,
)
