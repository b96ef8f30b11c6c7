"""The default rule's direction stage: the voters whose update direction lies within the
tightest single-linkage group of ``1 - direction_trim`` of the rows, so a backdoor minority
whose updates share a direction is left out even when each of its coordinates stays within
the honest spread (a trigger cut between attackers, DBA)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import create_aggregator
from murmura.aggregation.base import AggregationError
from murmura.aggregation.directions import linkage_group, majority_cluster

P = 400


def honest_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """A shared descent direction plus each client's own (non-IID) part and noise."""
    common = np.full(P, 1.0 / np.sqrt(P))
    return (common + 0.6 * rng.standard_normal((n, P)) / np.sqrt(P)).astype(np.float32)


def backdoor_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Honest-looking rows that all add one extra direction of ordinary size: no coordinate
    leaves the honest range by much, the direction does."""
    goal = np.zeros(P)
    goal[:40] = 1.0 / np.sqrt(40)
    return (honest_rows(rng, n) + 0.9 * goal).astype(np.float32)


def run(agg, x: np.ndarray, ids: list[str]) -> np.ndarray:
    for u, cid in zip(x, ids, strict=True):
        agg.add(u, 10.0, client_id=cid)
    out = agg.result()
    effective = agg.last_effective.copy()
    agg.reset()
    assert np.isfinite(out).all()
    return effective


@pytest.mark.parametrize("seed", range(3))
def test_a_minority_sharing_a_direction_gets_no_vote(seed: int) -> None:
    # Prepare: 20 honest rows and 5 distinct attackers pulling one way (20%)
    rng = np.random.default_rng(seed)
    x = np.vstack([honest_rows(rng, 20), backdoor_rows(rng, 5)])
    ids = [f"h{i}" for i in range(20)] + [f"a{i}" for i in range(5)]
    # Execute: the default rule, its screen off (the stage alone)
    effective = run(create_aggregator("default", P, screen=False), x, ids)
    # Assert: no attacker votes; the group (at least 75% of the 25 rows) is all honest
    np.testing.assert_array_equal(effective[20:], 0.0)
    assert (effective[:20] > 0).sum() >= math.ceil(0.75 * 25)


def test_without_the_stage_the_same_minority_votes() -> None:
    rng = np.random.default_rng(0)
    x = np.vstack([honest_rows(rng, 20), backdoor_rows(rng, 5)])
    ids = [f"h{i}" for i in range(20)] + [f"a{i}" for i in range(5)]
    effective = run(create_aggregator("default", P, screen=False, direction_trim=0.0), x, ids)
    assert (effective > 0).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 40), trim=st.sampled_from([0.1, 0.25, 0.4]),
       seed=st.integers(0, 2**16))
def test_the_stage_leaves_out_at_most_its_share(n: int, trim: float, seed: int) -> None:
    # Any rows (no attack): the group holds at least ceil((1 - trim) n) of them
    rng = np.random.default_rng(seed)
    x = honest_rows(rng, n)
    ids = [f"c{i}" for i in range(n)]
    agg = create_aggregator("default", P, screen=False, norm_cap=None, direction_trim=trim)
    effective = run(agg, x, ids)
    assert (effective > 0).sum() >= math.ceil((1 - trim) * n)


def test_a_small_buffer_is_judged_with_the_history_rows() -> None:
    # Prepare: 30 honest clients vote in small buffers, filling the history
    rng = np.random.default_rng(4)
    honest = [f"h{i}" for i in range(30)]
    with_history = create_aggregator("default", P, screen=False)
    without = create_aggregator("default", P, screen=False, history=0)
    for start in range(0, 30, 6):
        for agg in (with_history, without):
            run(agg, honest_rows(rng, 6), honest[start:start + 6])
    # Execute: a buffer of 4 in which one attacker pulls its own way
    x = np.vstack([honest_rows(rng, 3), backdoor_rows(rng, 1)])
    ids = honest[:3] + ["a0"]
    kept_with = run(with_history, x, ids)
    kept_without = run(without, x, ids)
    # Assert: four rows alone are too few to judge (MIN_DIRECTION_ROWS), so the attacker
    # votes; with the history's rows of other clients it is the one left out
    assert kept_with[3] == 0.0 and (kept_with[:3] > 0).all()
    assert kept_without[3] > 0


def test_more_voters_than_max_rows_are_judged_against_a_seeded_subset() -> None:
    # 160 honest rows and 40 attackers, max_rows 64: the group is found on 64 rows and every
    # voter is admitted by its nearest member's distance
    rng = np.random.default_rng(5)
    x = np.vstack([honest_rows(rng, 160), backdoor_rows(rng, 40)])
    ids = [f"h{i}" for i in range(160)] + [f"a{i}" for i in range(40)]
    first = run(create_aggregator("default", P, screen=False), x, ids)
    again = run(create_aggregator("default", P, screen=False), x, ids)
    np.testing.assert_array_equal(first, again)  # seeded: repeatable
    assert (first[160:] == 0).all()
    assert (first[:160] > 0).sum() >= 120


def test_linkage_group_reports_the_height_of_the_merge_that_completed_it() -> None:
    pos = np.array([0.0, 0.1, 0.3, 0.6, 5.0, 5.2])
    d = np.abs(pos[:, None] - pos[None, :])
    group, height = linkage_group(d, min_size=4)
    np.testing.assert_array_equal(group, pos < 1)
    assert height == pytest.approx(0.3)
    np.testing.assert_array_equal(majority_cluster(d, min_size=4), group)
    everyone, none = linkage_group(d, min_size=1)
    assert everyone.all() and none == 0.0


@pytest.mark.parametrize("trim", [-0.1, 0.5, 0.9])
def test_a_trim_outside_its_range_is_refused(trim: float) -> None:
    with pytest.raises(AggregationError, match="direction_trim"):
        create_aggregator("default", P, direction_trim=trim)


def test_a_group_outside_buffer_after_buffer_leaves_past_the_share() -> None:
    # Prepare: 30 other honest clients fill the history; then buffers of 10 in which the
    # same 3 attackers (30%) pull one way: more than the stage's share (2 of 10) of a buffer
    rng = np.random.default_rng(6)
    struck = create_aggregator("default", P, screen=False)
    capped = create_aggregator("default", P, screen=False, strike_limit=None)
    warm = [f"w{i}" for i in range(30)]
    for start in range(0, 30, 10):
        x = honest_rows(rng, 10)
        for agg in (struck, capped):
            run(agg, x, warm[start:start + 10])
    ids = [f"h{i}" for i in range(7)] + [f"a{i}" for i in range(3)]
    votes: dict[str, list[int]] = {"struck": [], "capped": []}
    honest_votes = []
    for _ in range(3):
        x = np.vstack([honest_rows(rng, 7), backdoor_rows(rng, 3)])
        for name, agg in (("struck", struck), ("capped", capped)):
            effective = run(agg, x, ids)
            votes[name].append(int((effective[7:] > 0).sum()))
            if name == "struck":
                honest_votes.append(int((effective[:7] > 0).sum()))
    # Assert: the first buffer keeps one attacker (the share caps the stage); from the
    # second, the attackers, outside in their last two buffers, all leave; without strikes
    # one votes in every buffer. An honest row now and then is struck too (the price).
    assert votes["struck"] == [1, 0, 0]
    assert votes["capped"] == [1, 1, 1]
    assert min(honest_votes) >= 5
    # each buffer outside counts 1, each older one half as much: 1, 1.5, 1.75
    state = struck.state_dict()
    counts = dict(zip(state["strikes.ids"].tolist(), state["strikes.count"].tolist(),
                      strict=True))
    assert [counts[f"a{i}"] for i in range(3)] == [1.75] * 3
    # and the counts survive a restart (state_dict / load_state_dict)
    again = create_aggregator("default", P, screen=False)
    again.load_state_dict(state)
    assert again.state_dict()["strikes.count"].tolist() == state["strikes.count"].tolist()


@pytest.mark.parametrize("options", [{"strike_limit": 0.0}, {"strike_limit": float("nan")},
                                     {"strike_decay": 1.0}, {"strike_decay": -0.1}])
def test_bad_strike_options_are_refused(options: dict[str, float]) -> None:
    with pytest.raises(AggregationError, match="strike"):
        create_aggregator("default", P, **options)


def test_malformed_strike_state_is_refused() -> None:
    agg = create_aggregator("default", P, screen=False)
    state = agg.state_dict()
    state["strikes.ids"] = np.array(["a", "b"], dtype=str)
    state["strikes.count"] = np.array([1.0])
    with pytest.raises(AggregationError, match="strikes"):
        agg.load_state_dict(state)
