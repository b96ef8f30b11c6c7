"""Seeded data partitioners: how examples are spread over clients.

Each returns one index array per client; the same seed always gives the same split, so a
client process can compute its own share without any data moving.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from murmura.tasks.config import PARTITIONERS

Index = npt.NDArray[np.int64]


def _check(n: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if n < num_clients:
        raise ValueError(f"{n} examples cannot give each of {num_clients} clients one")


def iid(labels: npt.NDArray[np.int64], num_clients: int, *, seed: int) -> list[Index]:
    """Uniformly shuffled, near-equal shares."""
    _check(len(labels), num_clients)
    perm = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


def dirichlet(labels: npt.NDArray[np.int64], num_clients: int, *, alpha: float, seed: int,
              min_size: int = 2) -> list[Index]:
    """Label skew: each class is spread over clients by proportions drawn from Dir(alpha).

    Smaller alpha gives more skew. Draws repeat (deterministically) until every client has at
    least ``min_size`` examples, as in Hsu et al., https://arxiv.org/abs/1909.06335.
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    _check(len(labels), num_clients)
    if len(labels) < num_clients * min_size:
        raise ValueError(f"{len(labels)} examples cannot give {num_clients} clients "
                         f"{min_size} each")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(1000):
        shares: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            members = np.flatnonzero(labels == c)
            rng.shuffle(members)
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(p)[:-1] * len(members)).astype(int)
            for k, part in enumerate(np.split(members, cuts)):
                shares[k].extend(part.tolist())
        if min(len(s) for s in shares) >= min_size:
            return [np.sort(np.asarray(s, dtype=np.int64)) for s in shares]
    raise ValueError(f"could not give every client {min_size} examples with alpha={alpha}")


def shards(labels: npt.NDArray[np.int64], num_clients: int, *, shards_per_client: int = 2,
           seed: int) -> list[Index]:
    """Sort by label, cut into equal shards, deal each client a few (McMahan et al.)."""
    _check(len(labels), num_clients * shards_per_client)
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, num_clients * shards_per_client)
    deal = rng.permutation(len(pieces))
    return [np.sort(np.concatenate([pieces[j] for j in
                                    deal[k * shards_per_client:(k + 1) * shards_per_client]]))
            for k in range(num_clients)]


def quantity_skew(labels: npt.NDArray[np.int64], num_clients: int, *, alpha: float = 1.0,
                  seed: int, min_size: int = 1) -> list[Index]:
    """IID labels, but share sizes drawn from Dir(alpha): a few clients hold most data."""
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    _check(len(labels), num_clients * min_size)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    spare = len(labels) - num_clients * min_size
    sizes = min_size + np.floor(rng.dirichlet(np.full(num_clients, alpha)) * spare).astype(int)
    sizes[: spare - (sizes.sum() - num_clients * min_size)] += 1
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(p) for p in np.split(perm, cuts)]



def partition(labels: npt.NDArray[np.int64], num_clients: int, *, scheme: str, seed: int,
              alpha: float = 0.5) -> list[Index]:
    """Dispatch by name: iid, dirichlet (alpha), shards, quantity (alpha)."""
    if scheme == "iid":
        return iid(labels, num_clients, seed=seed)
    if scheme == "dirichlet":
        return dirichlet(labels, num_clients, alpha=alpha, seed=seed)
    if scheme == "shards":
        return shards(labels, num_clients, seed=seed)
    if scheme == "quantity":
        return quantity_skew(labels, num_clients, alpha=alpha, seed=seed)
    raise ValueError(f"unknown partition scheme {scheme!r}; use one of {', '.join(PARTITIONERS)}")
