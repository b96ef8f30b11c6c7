"""The bundled ``synthetic`` task written as an app file (docs/apps.md).

Gaussian class clusters (12,000 examples, 64 features, 10 classes), a sixth held out for the
server's test set, Dirichlet(0.5) label skew over clients: what ``--task synthetic`` trains
(tests/tasks/test_app.py checks that they agree).
"""

from __future__ import annotations

from functools import cache

from torch import nn

from murmura.tasks import ArrayDataset, make_synthetic, mlp, partition, train_test_split

SEED = 0


@cache
def _splits() -> tuple[ArrayDataset, ArrayDataset]:
    full = make_synthetic(num_examples=12_000, seed=SEED)
    return train_test_split(full, test_fraction=1 / 6, seed=SEED)


def model() -> nn.Module:
    return mlp(64, 64, 10)


def client_data(index: int, num_clients: int) -> ArrayDataset:
    train, _ = _splits()
    shares = partition(train.y, num_clients, scheme="dirichlet", seed=SEED, alpha=0.5)
    return train.subset(shares[index])


def test_data() -> ArrayDataset:
    return _splits()[1]
