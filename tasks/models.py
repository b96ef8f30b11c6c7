"""Small torch models for the bundled tasks, and evaluation on array data."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from murmura.tasks.data import ArrayDataset


def mlp(in_features: int = 64, hidden: int = 64, num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def logistic_regression(in_features: int = 64, num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, num_classes))


@torch.no_grad()
def evaluate(model: nn.Module, data: ArrayDataset, *, batch_size: int = 1024) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``data``."""
    model.eval()
    device = next(model.parameters()).device
    correct, loss_sum = 0, 0.0
    for start in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[start:start + batch_size]).to(device)
        y = torch.from_numpy(data.y[start:start + batch_size]).to(device)
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    n = max(len(data), 1)
    return {"accuracy": correct / n, "loss": loss_sum / n}


def seeded_init(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build a model with torch's RNG seeded, leaving the global RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    return model

