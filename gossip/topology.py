"""Whom a peer sends to in a round: pure functions of (seed, round, peer id, known peers).

Real peers (:class:`~murmura.gossip.PeerRuntime`) and simulated ones
(:mod:`murmura.simulation.gossip`) call these same functions, so a simulated run makes the
decisions a deployed one makes. Randomness is a SHA-256 hash of (seed, round, peer id, salt):
every peer computes the same answer for any peer without coordination.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

__all__ = [
    "epidemic_targets",
    "expected_senders",
    "k_regular_targets",
    "modest_sample",
    "ring_targets",
    "round_rng",
    "stable_hash",
    "targets",
]


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same on every machine and Python run."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def round_rng(seed: int, round_: int, peer: str, salt: str = "") -> random.Random:
    """The generator a peer's decisions in ``round_`` draw from."""
    return random.Random(stable_hash(seed, round_, peer, salt))


def epidemic_targets(peer: str, round_: int, view: Sequence[str], fanout: int, *,
                     seed: int) -> list[str]:
    """Epidemic Learning: ``fanout`` distinct random peers of the view (all if fewer).

    de Vos et al., "Epidemic Learning: Boosting Decentralized Learning with Randomized
    Communication", NeurIPS 2023, https://arxiv.org/abs/2310.01972 (EL-Local: each node sends
    to s random nodes of its local view every round).
    """
    pool = sorted(p for p in set(view) if p != peer)
    if len(pool) <= fanout:
        return pool
    return sorted(round_rng(seed, round_, peer, "el").sample(pool, fanout))


def _ring_order(peer: str, members: Sequence[str]) -> list[str]:
    ids = sorted(set(members) | {peer})
    i = ids.index(peer)
    return ids[i + 1:] + ids[:i]  # the others, starting from the successor


def ring_targets(peer: str, members: Sequence[str]) -> list[str]:
    """A directed ring in id order: the successor only."""
    order = _ring_order(peer, members)
    return order[:1]


def k_regular_targets(peer: str, members: Sequence[str], degree: int) -> list[str]:
    """An undirected ring lattice in id order: ceil(degree/2) successors and floor(degree/2)
    predecessors, so every peer has ``degree`` neighbours when there are enough peers."""
    order = _ring_order(peer, members)
    if len(order) <= degree:
        return sorted(order)
    ahead, behind = (degree + 1) // 2, degree // 2
    chosen = order[:ahead] + (order[-behind:] if behind else [])
    return sorted(set(chosen))


def modest_sample(round_: int, members: Sequence[str], size: int, *, seed: int,
                  role: str = "train") -> list[str]:
    """MoDeST-style sampling: the ``size`` members with the smallest hash of (seed, round,
    role, id). Every peer that knows the same members computes the same sample.

    de Vos et al., "MoDeST: Bridging the Gap between Federated and Decentralized Learning with
    Decentralized Sampling", 2023, https://arxiv.org/abs/2302.13837.
    """
    ranked = sorted(set(members), key=lambda p: (stable_hash(seed, round_, role, p), p))
    return ranked[:size]


def targets(topology: str, peer: str, round_: int, view: Sequence[str], *, fanout: int,
            degree: int, seed: int) -> list[str]:
    """The peers ``peer`` sends its model to in ``round_`` under ``topology``."""
    if topology == "epidemic":
        return epidemic_targets(peer, round_, view, fanout, seed=seed)
    if topology == "ring":
        return ring_targets(peer, view)
    if topology == "k-regular":
        return k_regular_targets(peer, view, degree)
    raise ValueError(f"topology {topology!r} has no per-peer targets (modest samples rounds)")


def expected_senders(topology: str, peer: str, members: Sequence[str], *, degree: int) -> int:
    """How many models a peer should receive per round when every member is up: the in-degree
    for the deterministic topologies, 1 for epidemic (the expected in-degree is s, but any
    one peer may receive none)."""
    if topology == "ring":
        return 1 if len(set(members) - {peer}) >= 1 else 0
    if topology == "k-regular":
        everyone = sorted(set(members) | {peer})
        return len([p for p in everyone
                    if p != peer and peer in k_regular_targets(p, everyone, degree)])
    return 1
