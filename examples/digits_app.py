"""The bundled ``digits`` task written as an app file (docs/apps.md).

``murmura run --app examples/digits_app.py`` trains what ``murmura run --task digits`` trains:
the same model, the same Dirichlet(0.5) split over clients and the same test set
(tests/tasks/test_app.py checks that, so this file cannot drift from the bundled task).
"""

from __future__ import annotations

from functools import cache

from torch import nn

from murmura.tasks import ArrayDataset, load_digits, mlp, partition

SEED = 0


@cache
def _splits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_digits(seed=SEED)  # 1,797 8x8 images bundled with scikit-learn


def model() -> nn.Module:
    return mlp(64, 64, 10)


def client_data(index: int, num_clients: int) -> ArrayDataset:
    train, _ = _splits()
    shares = partition(train.y, num_clients, scheme="dirichlet", seed=SEED, alpha=0.5)
    return train.subset(shares[index])


def test_data() -> ArrayDataset:
    return _splits()[1]
