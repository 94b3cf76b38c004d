"""What the cases share: a tiny model and a batch."""

from __future__ import annotations

import torch
from torch import nn


def tiny(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(6, 8)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    # SGD keeps no step counter: capturable as it is
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
