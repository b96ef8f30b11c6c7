"""A plain Flower NumPyClient (no Murmura imports) that Murmura runs unchanged.

A small torch MLP on scikit-learn's bundled digits (8x8 images, 10 classes; nothing is
downloaded). Each client trains on its ``partition-id``-th share of the training split.

    murmura server --flower-app examples/flower_client.py:client_fn --max-versions 5 ...
    murmura client --flower-app examples/flower_client.py:client_fn --client-index 0 ...

The same file works in Flower: ``app`` is a ``ClientApp`` for ``flwr run`` or
``run_simulation``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits
from torch import nn


def load_data(partition_id: int, num_partitions: int) -> tuple[Any, Any, Any, Any]:
    """This client's share of the training split, and the common test split."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    share = np.array_split(np.arange(len(y_train)), num_partitions)[partition_id]
    return x_train[share], y_train[share], x_test, y_test


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


class DigitsClient(NumPyClient):
    def __init__(self, partition_id: int = 0, num_partitions: int = 1) -> None:
        self.model = make_model()
        self.x, self.y, self.x_test, self.y_test = load_data(partition_id, num_partitions)

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [v.detach().cpu().numpy() for v in self.model.state_dict().values()]

    def set_parameters(self, parameters: list[np.ndarray]) -> None:
        keys = self.model.state_dict().keys()
        self.model.load_state_dict({k: torch.from_numpy(np.asarray(v))
                                    for k, v in zip(keys, parameters, strict=True)})

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, float]]:
        self.set_parameters(parameters)
        lr = float(config.get("lr", 0.1))
        epochs = int(config.get("local_epochs", 1))
        batch = int(config.get("batch_size", 32))
        gen = torch.Generator().manual_seed(int(config.get("seed", 0)))
        opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        x, y = torch.from_numpy(self.x), torch.from_numpy(self.y)
        loss = torch.zeros(())
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=gen)
            for s in range(0, len(y), batch):
                idx = perm[s : s + batch]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x[idx]), y[idx])
                loss.backward()
                opt.step()
        return self.get_parameters({}), len(y), {"train_loss": float(loss.detach())}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]
                 ) -> tuple[float, int, dict[str, float]]:
        self.set_parameters(parameters)
        with torch.no_grad():
            out = self.model(torch.from_numpy(self.x_test))
            y = torch.from_numpy(self.y_test)
            loss = float(nn.functional.cross_entropy(out, y))
            acc = float((out.argmax(1) == y).float().mean())
        return loss, len(y), {"accuracy": acc}


def client_fn(context: Any) -> Any:
    """Flower's factory: the node's partition comes from ``context.node_config``."""
    cfg = context.node_config
    return DigitsClient(int(cfg.get("partition-id", 0)),
                        int(cfg.get("num-partitions", 1))).to_client()


app = ClientApp(client_fn=client_fn)
