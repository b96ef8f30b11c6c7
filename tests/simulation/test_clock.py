"""Virtual clock and event queue: time only moves forward; ties keep insertion order."""

from __future__ import annotations

import math

import pytest

from murmura.simulation import EventQueue, VirtualClock


def test_clock_moves_only_forward() -> None:
    clock = VirtualClock()
    clock.advance_to(3.5)
    assert clock() == clock.now == 3.5
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(1.0)


def test_events_come_out_in_time_order_and_ties_in_insertion_order() -> None:
    q: EventQueue[str] = EventQueue()
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        q.push(t, name)
    out = [q.pop()[1] for _ in range(len(q))]
    assert out == ["first", "a", "b", "c", "d"]
    assert q.peek_time() == math.inf and not q


def test_event_times_must_be_valid() -> None:
    q: EventQueue[int] = EventQueue()
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError):
            q.push(bad, 0)
