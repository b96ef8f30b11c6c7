"""The aggregator's memories of past requests are bounded in entries and in age."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from murmura.server.recent import RecentMap
from tests.server.test_core import Clock, joined, make_core, push


def test_entries_expire_by_age_and_by_count() -> None:
    clock = Clock()
    m: RecentMap[str, int] = RecentMap(3, 10.0, clock)
    for i, key in enumerate("abcd"):
        m[key] = i
        clock.t += 1
    assert list(m) == ["b", "c", "d"]  # the count bound took the oldest
    m["b"] = 9                          # set again: new again
    assert list(m) == ["c", "d", "b"] and m["b"] == 9
    clock.t = 13.5                      # c was set at 2, d at 3, b at 4
    assert m.expire() == 2 and list(m) == ["b"] and m.get("c") is None
    assert RecentMap(1, 0.0, clock).expire() == 0  # ttl 0: no age bound


@example(ops=[(0, 1.0042224055782702), (1, 3.0)], cap=2, ttl=3.0)  # a rounded cut-off kept it
@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0, 5)), max_size=60),
       st.integers(1, 8), st.floats(0.5, 20))
def test_never_more_than_max_items_and_nothing_older_than_ttl(ops, cap, ttl) -> None:
    clock = Clock()
    m: RecentMap[int, float] = RecentMap(cap, ttl, clock)
    set_at: dict[int, float] = {}
    for key, dt in ops:
        clock.t += dt
        m[key] = clock.t
        set_at[key] = clock.t
        m.expire()
        assert len(m) <= cap
        assert all(clock.t - set_at[k] < ttl for k in m)
        assert all(m[k] == set_at[k] for k in m)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        RecentMap(0, 1.0, Clock())


def test_the_core_forgets_counted_updates_after_dedup_ttl_but_not_before() -> None:
    clock = Clock()
    core = make_core(clock, mode="async", buffer_size=10, min_clients=1, dedup_ttl_s=600,
                     session_ttl_s=0)
    (a,) = joined(core, "a")
    assert not push(core, a, [1, 1, 1, 1], uid="u1").duplicate
    clock.t += 599
    core.tick()
    assert push(core, a, [1, 1, 1, 1], uid="u1").duplicate  # a retry within the window
    core.leave(a)
    clock.t += 2
    core.tick()
    assert len(core._seen) == 0 and len(core._counted) == 0
    assert len(core._left) == 1  # the session ended 2 s ago: its end is still told
    clock.t += 600
    core.tick()
    assert len(core._left) == 0
