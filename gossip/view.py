"""The peer-sampling service's state: a bounded view of other peers.

A Cyclon-flavoured shuffle (Voulgaris et al., "CYCLON: Inexpensive Membership Management for
Unstructured P2P Overlays", 2005): every round a peer sends ``shuffle_size`` entries of its
view (itself among them, fresh) to one view member, which answers with entries of its own;
both merge, keeping the freshest entry per peer and at most ``view_size`` entries, dropping
the oldest first. So a peer knows O(view_size) others whatever the network size, the views
keep mixing, and entries of departed peers age out. Pure state; no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

from murmura.protocols import PeerInfo

__all__ = ["PeerEntry", "PeerView"]

#: What a view knows about a peer: its id, its address, how fresh the entry is.
PeerEntry = PeerInfo


class PeerView:
    """At most ``size`` entries; never contains the owner."""

    def __init__(self, owner: str, size: int, *, seed: int = 0, max_age: int = 0) -> None:
        if size < 1:
            raise ValueError(f"view size must be >= 1, got {size}")
        self.owner, self.size = owner, size
        self.max_age = max_age or 4 * size
        self._entries: dict[str, PeerEntry] = {}
        self._rng = random.Random(f"view:{owner}:{seed}")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._entries

    def ids(self) -> list[str]:
        return sorted(self._entries)

    def get(self, peer_id: str) -> PeerEntry | None:
        return self._entries.get(peer_id)

    def entries(self) -> list[PeerEntry]:
        return [self._entries[k] for k in sorted(self._entries)]

    def merge(self, entries: Iterable[PeerEntry]) -> None:
        """Take in entries, keep the freshest per peer, then trim the oldest beyond ``size``."""
        for e in entries:
            if e.peer_id == self.owner or not e.peer_id or not e.address:
                continue
            old = self._entries.get(e.peer_id)
            if old is None or (e.age, -e.round) < (old.age, -old.round):
                self._entries[e.peer_id] = e
        if len(self._entries) > self.size:
            ranked = sorted(self._entries.values(), key=lambda e: (e.age, -e.round, e.peer_id))
            self._entries = {e.peer_id: e for e in ranked[: self.size]}

    def remove(self, peer_id: str) -> None:
        self._entries.pop(peer_id, None)

    def tick(self) -> None:
        """One shuffle period passed: every entry is one older; entries older than
        ``max_age`` (a peer nobody has heard from directly for that long) are dropped."""
        self._entries = {k: replace(e, age=e.age + 1) for k, e in self._entries.items()
                         if e.age + 1 <= self.max_age}

    def shuffle_partner(self) -> PeerEntry | None:
        """The oldest entry (Cyclon's choice: it is the likeliest to be stale)."""
        if not self._entries:
            return None
        return max(self._entries.values(), key=lambda e: (e.age, e.peer_id))

    def sample(self, k: int) -> list[PeerEntry]:
        """Up to ``k`` random entries (what goes out in a shuffle)."""
        entries = self.entries()
        if len(entries) <= k:
            return entries
        return self._rng.sample(entries, k)
