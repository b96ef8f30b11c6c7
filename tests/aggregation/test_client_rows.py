"""ClientRows: bounded per-client rows (least recently observed evicted first, rows reused,
growth keeps every row's content)."""

from __future__ import annotations

import numpy as np

from murmura.aggregation.client_rows import ClientRows


def rows(capacity: int = 3) -> ClientRows:
    return ClientRows(capacity, {"v": ((2,), np.float32, 0.0), "t": ((), np.int64, -1)})


def test_a_new_client_gets_a_filled_row_and_keeps_it() -> None:
    r = rows()
    a = r.row("a")
    r.arrays["v"][a] = [1.0, 2.0]
    assert r.row("a") == a and list(r.arrays["v"][a]) == [1.0, 2.0]
    b = r.row("b")
    assert b != a and list(r.arrays["v"][b]) == [0.0, 0.0] and r.arrays["t"][b] == -1


def test_the_least_recently_observed_client_is_evicted_and_its_row_reused() -> None:
    r = rows(capacity=2)
    a, _ = r.row("a"), r.row("b")
    r.arrays["v"][a] = 5.0
    r.row("a")  # a is now the most recent: b goes
    c = r.row("c")
    assert "b" not in r and "a" in r and len(r) == 2
    assert list(r) == ["a", "c"] and list(r.arrays["v"][c]) == [0.0, 0.0]


def test_forgotten_rows_are_cleared_and_reused_and_growth_keeps_rows() -> None:
    r = rows(capacity=1000)
    for i in range(100):  # past the first allocation of 64 rows
        row = r.row(str(i))  # first: growing replaces the arrays
        r.arrays["v"][row] = i
    assert all(r.arrays["v"][r.slots[str(i)]][0] == i for i in range(100))
    slot = r.slots["7"]
    r.forget("7")
    assert "7" not in r and r.arrays["v"][slot][0] == 0.0
    assert r.row("new") == slot


def test_export_and_load_round_trip_keep_the_newest() -> None:
    r = rows(capacity=5)
    for i in range(4):
        row = r.row(f"c{i}")
        r.arrays["t"][row] = i
    state = r.export()
    other = rows(capacity=2)
    other.load([str(x) for x in state["ids"]], state)
    assert list(other) == ["c2", "c3"] and list(other.arrays["t"]) == [2, 3]
