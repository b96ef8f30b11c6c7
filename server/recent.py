"""A map that forgets: bounded in entries and in age.

The aggregator remembers counted update ids (so a retried push counts once), counted payload
hashes (so a copied update is refused) and ended sessions (so their clients get a clear
error). Each only needs to remember as long as a retry, a copy or a late call can come; a
count bound alone keeps 100 000 entries around for good once reached, so a server's memory
would never come back down after a busy hour. Entries are kept in the order they were set,
which is their age order, so expiring them costs only the entries that go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["RecentMap"]


class RecentMap(Generic[K, V]):
    """At most ``max_items`` entries, none older than ``ttl_s`` once :meth:`expire` has run
    (``ttl_s`` 0: no age bound). Setting a key again makes it new."""

    def __init__(self, max_items: int, ttl_s: float, clock: Callable[[], float]) -> None:
        if max_items < 1 or ttl_s < 0:
            raise ValueError("RecentMap needs max_items >= 1 and ttl_s >= 0")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.clock = clock
        self._items: OrderedDict[K, tuple[V, float]] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        self._items.pop(key, None)
        self._items[key] = (value, self.clock())
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def __getitem__(self, key: K) -> V:
        return self._items[key][0]

    def get(self, key: K, default: V | None = None) -> V | None:
        item = self._items.get(key)
        return default if item is None else item[0]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def values(self) -> Iterator[V]:
        return (value for value, _ in self._items.values())

    def expire(self, now: float | None = None) -> int:
        """Drop the entries older than ``ttl_s``; how many went."""
        if not self.ttl_s:
            return 0
        now = self.clock() if now is None else now
        dropped = 0
        while self._items:
            _, (_, t) = next(iter(self._items.items()))
            if now - t < self.ttl_s:  # the age as the clock gives it, no rounded cut-off
                break
            self._items.popitem(last=False)
            dropped += 1
        return dropped
