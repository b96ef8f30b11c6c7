"""A custom app file for the app tests: its own tiny model, its own generated data, its own
train and evaluate functions and a named aggregation rule, plus a log of what it measured."""

from __future__ import annotations

from pathlib import Path

APP = '''
"""Test app: two-feature blobs, a tiny MLP, an evaluation log, a custom rule."""
import json
import os

import numpy as np
import torch
from torch import nn

from murmura.aggregation import WeightedMean, aggregation_rule

LOG = os.environ.get("APP_TEST_LOG", "")
SERVER_TEST = 400


def _log(record):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\\n")


def model():
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))


def _blobs(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.normal(0, 1.2, (n, 2)) + np.where(y[:, None] == 1, 1.0, -1.0)
    return x.astype(np.float32), y.astype(np.int64)


def client_data(index, num_clients):
    return _blobs(120, seed=100 + index)


def client_test_data(index, num_clients):
    return _blobs(30 + 20 * index, seed=500 + index)   # sizes differ: a weighted mean


def test_data():
    return _blobs(SERVER_TEST, seed=7)


def train(model, data, settings, seed):
    x, y = (torch.from_numpy(a) for a in data)
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr)
    for _ in range(settings.local_epochs):
        for s in range(0, len(y), settings.batch_size):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[s:s + settings.batch_size]),
                                        y[s:s + settings.batch_size]).backward()
            opt.step()
    return {"num_examples": len(y), "custom_train": 1.0}


def evaluate(model, data):
    x, y = (torch.from_numpy(a) for a in data)
    out = model(x)
    acc = float((out.argmax(1) == y).float().mean())
    loss = float(nn.functional.cross_entropy(out, y))
    _log({"examples": len(y), "accuracy": acc, "loss": loss})
    return {"accuracy": acc, "loss": loss}


class Frozen(WeightedMean):
    """A rule that never moves the model: proves the run used it."""

    def result(self):
        return np.zeros(self.size, dtype=np.float32)


@aggregation_rule("frozen-RULE_SUFFIX")
def frozen(size, **options):
    if size > 16:  # the config check probes a 16-value instance
        _log({"rule": "frozen", "size": size})
    return Frozen(size)
'''


def write_app(directory: Path, name: str = "custom_app", suffix: str = "") -> Path:
    """Write the app as ``directory/NAME.py``; ``suffix`` names its rule ``frozen-SUFFIX``
    (rule names are process-wide, so apps loaded in one process need different ones)."""
    path = directory / f"{name}.py"
    path.write_text(APP.replace("RULE_SUFFIX", suffix or name), encoding="utf-8")
    return path
