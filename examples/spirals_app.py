"""An app with its own torch model, its own data and its own aggregation rule (docs/apps.md).

Two interleaved spirals, split so that each client sees a different stretch of them
(non-IID), a small residual MLP written as a torch module, and a norm-clipped mean registered
as ``spirals-clipped-mean``. Run it::

    murmura run --app examples/spirals_app.py --clients 4 --max-versions 20 --in-process \\
        --client-eval-every 5 --defense spirals-clipped-mean
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from murmura.aggregation import BufferedAggregator, aggregation_rule
from murmura.protocols import TaskSettings

Arrays = tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]


class Net(nn.Module):
    """2 -> 64 -> 64 -> 2 with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(2, 64)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.hidden(h))
        return self.out(h)


def model() -> nn.Module:
    return Net()


def spirals(n: int, *, seed: int, lo: float = 0.0, hi: float = 1.0) -> Arrays:
    """``n`` points on two spirals, at positions drawn from [lo, hi) along them."""
    rng = np.random.default_rng(seed)
    t = lo + (hi - lo) * rng.random(n)
    label = rng.integers(0, 2, n)
    angle = 2 * np.pi * t + np.pi * label
    radius = 0.2 + t
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    x += rng.normal(0, 0.04, x.shape)
    return x.astype(np.float32), label.astype(np.int64)


def client_data(index: int, num_clients: int) -> Arrays:
    # Non-IID: client i holds mostly its own stretch of the spirals, and a little of the rest.
    lo, hi = index / num_clients, (index + 1) / num_clients
    own = spirals(200, seed=10 + index, lo=lo, hi=hi)
    rest = spirals(100, seed=100 + index)
    return np.concatenate([own[0], rest[0]]), np.concatenate([own[1], rest[1]])


def test_data() -> Arrays:
    return spirals(1000, seed=1)


def train(net: nn.Module, data: Arrays, settings: TaskSettings, seed: int) -> dict[str, float]:
    """Adam instead of Murmura's SGD; returns how many examples it trained on."""
    x, y = torch.from_numpy(data[0]), torch.from_numpy(data[1])
    opt = torch.optim.Adam(net.parameters(), lr=settings.lr)
    gen = torch.Generator().manual_seed(seed)
    net.train()
    total = 0.0
    for _ in range(settings.local_epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), settings.batch_size):
            rows = order[start:start + settings.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[rows]), y[rows])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(rows)
    return {"num_examples": len(y), "train_loss": total / (len(y) * settings.local_epochs)}


def evaluate(net: nn.Module, data: Arrays) -> dict[str, float]:
    x, y = torch.from_numpy(data[0]), torch.from_numpy(data[1])
    logits = net(x)
    outer = torch.from_numpy(np.linalg.norm(data[0], axis=1) > 0.8)
    right = logits.argmax(1) == y
    return {"accuracy": float(right.float().mean()),
            "loss": float(nn.functional.cross_entropy(logits, y)),
            "outer_accuracy": float(right[outer].float().mean()) if outer.any() else 0.0}


class ClippedMean(BufferedAggregator):
    """Weighted mean of updates clipped to ``scale`` x the median update norm, so no single
    client moves the model much further than a typical one."""

    name = "spirals-clipped-mean"

    def __init__(self, size: int, scale: float = 2.0) -> None:
        super().__init__(size)
        self.scale = float(scale)

    def combine(self, updates: npt.NDArray[np.float32], weights: npt.NDArray[np.float64],
                factors: npt.NDArray[np.float64], client_ids: Sequence[str]
                ) -> npt.NDArray[np.float32]:
        norms = np.linalg.norm(updates, axis=1)
        bound = self.scale * float(np.median(norms))
        shrink = np.minimum(1.0, bound / np.maximum(norms, 1e-12))
        w = weights * factors * shrink
        return (w @ updates / weights.sum()).astype(np.float32)


@aggregation_rule("spirals-clipped-mean")
def clipped_mean(size: int, scale: float = 2.0) -> ClippedMean:
    return ClippedMean(size, scale=scale)  # --defense-option scale=3
