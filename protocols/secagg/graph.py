"""The SecAgg+ neighbour graph: who shares with whom, and the threshold."""

from __future__ import annotations

import hashlib
import math

from murmura.protocols.secagg.keys import _MAX_ID, _u64

# --------------------------------------------------------------------------------------------
# Neighbour graph (SecAgg+)
# --------------------------------------------------------------------------------------------


def threshold(k: int) -> int:
    """Shamir threshold for a neighbourhood of degree ``k``: ``floor(k / 2) + 1``.

    More than half the neighbours are needed, so two disjoint groups of responders can never both
    reach the threshold: a server cannot collect self-mask shares of a client from one half of its
    neighbours and key shares from the other half (Bonawitz et al.; Bell et al. require
    ``t > k / 2`` for the same reason).
    """
    if k < 1:
        raise ValueError(f"the degree must be at least 1, got {k}")
    return k // 2 + 1


def _log_binom_pmf(k: int, s: int, p: float) -> float:
    if p == 0.0:
        return 0.0 if s == 0 else -math.inf
    if p == 1.0:
        return 0.0 if s == k else -math.inf
    log_comb = math.lgamma(k + 1) - math.lgamma(s + 1) - math.lgamma(k - s + 1)
    return log_comb + s * math.log(p) + (k - s) * math.log1p(-p)


def default_degree(
    n: int,
    dropout_fraction: float,
    *,
    failure_probability: float = 1e-6,
    log_factor: float = 3.0,
) -> int:
    """Neighbour degree ``k`` for ``n`` clients of which ``dropout_fraction`` may drop.

    Rule: the smallest ``k >= ceil(log_factor * log2 n)`` with ``n * k`` even (a ``k``-regular
    graph exists) such that, if each client drops independently with probability
    ``dropout_fraction``, the chance that *some* neighbourhood keeps fewer than ``threshold(k)``
    survivors is at most ``failure_probability`` (union bound over the ``n`` neighbourhoods of a
    binomial tail). It is capped at ``n - 1``, the complete graph of the original SecAgg. Since
    ``threshold(k) > k / 2``, ``dropout_fraction`` must be below 1/2. This is a simple documented
    rule in the spirit of Bell et al. (``k = O(log n)``), not their exact security bound.
    """
    if n < 2:
        raise ValueError(f"secure aggregation needs at least 2 clients, got {n}")
    if not 0.0 <= dropout_fraction < 0.5:
        raise ValueError(f"dropout_fraction must be in [0, 0.5), got {dropout_fraction}")
    if not 0.0 < failure_probability < 1.0 or log_factor <= 0:
        raise ValueError("failure_probability must be in (0, 1) and log_factor positive")
    start = max(2, math.ceil(log_factor * math.log2(n)))
    for k in range(start, n):
        if (n * k) % 2:
            continue
        t = threshold(k)
        tail = sum(math.exp(_log_binom_pmf(k, s, 1.0 - dropout_fraction)) for s in range(t))
        if n * tail <= failure_probability:
            return k
    return n - 1


def _seed_bytes(seed: bytes | int) -> bytes:
    if isinstance(seed, int):
        return _u64(seed)
    return bytes(seed)


def neighbours(n: int, k: int, seed: bytes | int) -> dict[int, frozenset[int]]:
    """A ``k``-regular symmetric graph on clients ``1..n``: a Harary graph on a seeded order.

    Clients are ordered by SHA-256 of (seed, id), a permutation that is the same on every platform
    and library version; position ``p`` is joined to positions ``p +- 1 .. p +- k // 2`` on the
    ring and, for odd ``k``, to the opposite position ``p + n / 2``: a Harary graph, as in Bell et
    al. ``k`` is capped at ``n - 1`` (the complete graph); an odd ``k`` with odd ``n`` has no
    regular graph and raises ``ValueError``.
    """
    if n < 2:
        raise ValueError(f"a neighbour graph needs at least 2 clients, got {n}")
    if n > _MAX_ID:
        raise ValueError(f"at most 2**32 - 1 clients, got {n}")
    if k < 1:
        raise ValueError(f"the degree must be at least 1, got {k}")
    k = min(k, n - 1)
    if (n * k) % 2:
        raise ValueError(f"no {k}-regular graph on {n} clients: n * k must be even")
    key = _seed_bytes(seed)
    order = sorted(
        range(1, n + 1),
        key=lambda i: hashlib.sha256(b"murmura/secagg/graph/v1" + key + _u64(i)).digest(),
    )
    adjacent: dict[int, set[int]] = {i: set() for i in order}
    for p, node in enumerate(order):
        offsets = list(range(1, k // 2 + 1)) + ([n // 2] if k % 2 else [])
        for d in offsets:
            other = order[(p + d) % n]
            adjacent[node].add(other)
            adjacent[other].add(node)
    return {i: frozenset(adjacent[i]) for i in range(1, n + 1)}
