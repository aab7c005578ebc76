"""The seeds' MLPs: ``SimpleNN`` (784-128-64-10) and the 2-layer MLP of the parallelism walk-through."""

import torch
import torch.nn as nn


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
        return self.fc(self.flatten(x))

    def layer_units(self) -> list[nn.Module]:
        return [m for m in self.fc if isinstance(m, nn.Linear)]


class MLP2(nn.Module):
    """Two linear layers: ``net1`` (784 -> hidden) splits by columns, ``net2`` (hidden -> 10) by rows under TP."""

    def __init__(self, hidden: int = 512):
        super().__init__()
        self.net1 = nn.Linear(28 * 28, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(torch.flatten(x, 1))))

    def layer_units(self) -> list[nn.Module]:
        return [self.net1, self.net2]
