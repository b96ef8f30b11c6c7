"""Virtual time: a clock the aggregator core reads, and a queue of timed events.

The simulation never sleeps. Time jumps from one event to the next, so an hour of federation
whose compute is small runs in seconds, and the order of events (which update arrives first,
which round closes when) follows from the simulated devices alone, never from the host's load.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

E = TypeVar("E")


class VirtualClock:
    """Seconds of simulated time; call it like ``time.monotonic``.

    It only moves forward, and only when the event loop says so (:meth:`advance_to`).
    """

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"start must be finite, got {start}")
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual time cannot go back from {self._now} to {t}")
        self._now = float(t)

    def __repr__(self) -> str:
        return f"VirtualClock(now={self._now:.6f})"


class EventQueue(Generic[E]):
    """Events ordered by time; events at the same time keep the order they were added in.

    The tie-break by insertion order makes a run deterministic: two clients whose messages
    reach the server at the same virtual instant are always served in the same order.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, E]] = []
        self._seq = 0

    def push(self, t: float, event: E) -> None:
        if not t >= 0 or math.isnan(t):
            raise ValueError(f"event time must be a non-negative number, got {t}")
        heapq.heappush(self._heap, (t, self._seq, event))
        self._seq += 1

    def push_trusted(self, t: float, event: E) -> None:
        """:meth:`push` without the check, for callers whose times are known to be valid."""
        heapq.heappush(self._heap, (t, self._seq, event))
        self._seq += 1

    def pop(self) -> tuple[float, E]:
        t, _, event = heapq.heappop(self._heap)
        return t, event

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


__all__ = ["EventQueue", "VirtualClock"]
