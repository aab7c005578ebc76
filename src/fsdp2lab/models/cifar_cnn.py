"""A CNN for 3x32x32 CIFAR-10 images (the scaling exercise's model), any batch size."""

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        assert x.shape[1:] == (3, 32, 32), f"expected N x 3 x 32 x 32 images, got {tuple(x.shape)}"
        x = self.block3(self.block2(self.block1(x)))
        x = self.dropout(torch.flatten(x, 1))
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)

    def layer_units(self) -> list[nn.Module]:
        return [self.block1, self.block2, self.block3, self.fc1, self.fc2]
