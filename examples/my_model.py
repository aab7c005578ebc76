"""A model of your own: `fsdp2lab train --model examples/my_model.py:build --input-shape 1,28,28`."""

import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ResidualMLP(nn.Module):
    def __init__(self, width: int, depth: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(28 * 28, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))  # the sharding units
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(width: int = 256, depth: int = 4) -> nn.Module:
    return ResidualMLP(width, depth)
