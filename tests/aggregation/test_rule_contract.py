"""The contract every registered aggregation rule keeps, checked over all of them.

A rule added to the library must be added to :data:`RULES` (with options that work on a few
small updates): ``test_every_library_rule_is_in_the_suite`` fails until it is. The properties:

* the result is a finite float32 vector of the model's size, and a fresh rule fed the same
  updates in the same order gives the same bits (reruns are reproducible);
* it amplifies nothing: every coordinate of the result lies between the smallest and the
  largest value any update has there (or 0, which clipping rules shrink towards), so no
  combination of honest-looking inputs can make a rule output something larger;
* ``count`` follows ``add``; an empty rule refuses ``result``; ``reset`` empties the buffer;
* bad input (a wrong shape, a weight that is not positive and finite, a negative or
  non-finite factor) is refused with :class:`AggregationError` and changes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import AggregationError, available_aggregators, create_aggregator
from murmura.aggregation.base import aggregator_factory

SIZE = 24

#: rule -> options that make it work on a handful of small updates (noise off: FLAME's noise
#: is deliberate and would break the bound below; sketches small, as the vectors are)
RULES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "clip": {},
    "median": {},
    "trimmed-mean": {"trim": 0.2},
    "krum": {"f": 1},
    "multi-krum": {"f": 1, "m": 3},
    "centered-clip": {},
    "sybil": {"dim": 16},
    "sybil-cclip": {"dim": 16},
    "default": {"dim": 16},
    "flame": {"dim": 0, "noise": 0.0},
    "dnc": {"subsample": 8, "f": 1},
}

#: the fewest updates every rule in the suite aggregates (Krum needs n > 2f + 2)
MIN_UPDATES = 5


def library_rules() -> set[str]:
    """Rules the library registers (tests and apps may register more of their own)."""
    return {name for name in available_aggregators()
            if getattr(aggregator_factory(name), "__module__", "").startswith(
                "murmura.aggregation")}


def test_every_library_rule_is_in_the_suite() -> None:
    missing = library_rules() - RULES.keys()
    assert not missing, f"add these rules to RULES in {__file__}: {sorted(missing)}"
    assert RULES.keys() <= library_rules(), "RULES names a rule the library does not have"


def make(name: str) -> Any:
    return create_aggregator(name, SIZE, **RULES[name])


def feed(agg: Any, rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    for i, (row, w) in enumerate(zip(rows, weights, strict=True)):
        agg.add(row, float(w), client_id=f"client-{i}")
    return agg.result()


rounds = st.tuples(
    st.integers(MIN_UPDATES, 9),   # updates
    st.integers(0, 2**32 - 1),     # seed of their values
    st.floats(0.01, 100.0),        # their scale
)


def updates(n: int, seed: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centre = rng.normal(size=SIZE)
    rows = (centre + 0.5 * rng.normal(size=(n, SIZE))) * scale
    weights = rng.integers(1, 50, size=n).astype(np.float64)
    return rows.astype(np.float32), weights


@pytest.mark.parametrize("name", sorted(RULES))
@settings(max_examples=25, deadline=None)
@given(case=rounds)
def test_results_are_finite_reproducible_and_amplify_nothing(name: str, case) -> None:
    rows, weights = updates(*case)
    out = feed(make(name), rows, weights)
    assert out.shape == (SIZE,) and out.dtype == np.float32 and np.isfinite(out).all()
    assert feed(make(name), rows, weights).tobytes() == out.tobytes()
    low = np.minimum(rows.min(axis=0), 0.0)
    high = np.maximum(rows.max(axis=0), 0.0)
    slack = 1e-5 * np.maximum(np.abs(low), np.abs(high)) + 1e-30
    assert (out >= low - slack).all() and (out <= high + slack).all(), (
        f"{name} left the inputs' box: worst by "
        f"{max(float((low - out).max()), float((out - high).max())):.3g}")


@pytest.mark.parametrize("name", sorted(RULES))
def test_count_reset_and_the_empty_rule(name: str) -> None:
    agg = make(name)
    with pytest.raises(AggregationError):
        agg.result()
    rows, weights = updates(MIN_UPDATES, 1, 1.0)
    for i, (row, w) in enumerate(zip(rows, weights, strict=True)):
        agg.add(row, float(w), client_id=f"client-{i}")
        assert agg.count == i + 1
    agg.result()
    agg.reset()
    assert agg.count == 0
    with pytest.raises(AggregationError):
        agg.result()


BAD_ADDS = {
    "short update": (np.zeros(SIZE - 1, np.float32), 1.0, 1.0),
    "2-d update": (np.zeros((2, SIZE), np.float32), 1.0, 1.0),
    "zero weight": (np.zeros(SIZE, np.float32), 0.0, 1.0),
    "negative weight": (np.zeros(SIZE, np.float32), -1.0, 1.0),
    "NaN weight": (np.zeros(SIZE, np.float32), float("nan"), 1.0),
    "infinite weight": (np.zeros(SIZE, np.float32), float("inf"), 1.0),
    "negative factor": (np.zeros(SIZE, np.float32), 1.0, -0.5),
    "NaN factor": (np.zeros(SIZE, np.float32), 1.0, float("nan")),
}


@pytest.mark.parametrize("bad", sorted(BAD_ADDS))
@pytest.mark.parametrize("name", sorted(RULES))
def test_bad_input_is_refused_and_changes_nothing(name: str, bad: str) -> None:
    rows, weights = updates(MIN_UPDATES, 2, 1.0)
    agg, clean = make(name), make(name)
    for i, (row, w) in enumerate(zip(rows[:-1], weights[:-1], strict=True)):
        agg.add(row, float(w), client_id=f"client-{i}")
        clean.add(row, float(w), client_id=f"client-{i}")
    update, weight, factor = BAD_ADDS[bad]
    with pytest.raises(AggregationError):
        agg.add(update, weight, factor=factor, client_id="bad")
    assert agg.count == MIN_UPDATES - 1
    last = len(rows) - 1
    agg.add(rows[-1], float(weights[-1]), client_id=f"client-{last}")
    clean.add(rows[-1], float(weights[-1]), client_id=f"client-{last}")
    assert agg.result().tobytes() == clean.result().tobytes()
