"""Robust rules: bounded outlier influence, near-mean behaviour, order invariance, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import AggregationError, create_aggregator, robust, robust_stats
from murmura.aggregation.fedavg import WeightedMean

RULES = {
    "clip": {},
    "median": {},
    "trimmed-mean": {"trim": 0.2},
    "krum": {"f": 2},
    "multi-krum": {"f": 2},
    "centered-clip": {},
}
FAST = settings(max_examples=15, deadline=None)


def aggregate(name: str, updates: np.ndarray, weights=None, factors=None, **options) -> np.ndarray:
    agg = create_aggregator(name, updates.shape[1], **(RULES.get(name, {}) | options))
    weights = np.full(len(updates), 10.0) if weights is None else weights
    factors = np.ones(len(updates)) if factors is None else factors
    for i, (u, w, f) in enumerate(zip(updates, weights, factors, strict=True)):
        agg.add(u, float(w), factor=float(f), client_id=f"c{i}")
    return agg.result()


def honest(seed: int, n: int = 11, p: int = 40, spread: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal(p)
    return (mu + spread * rng.standard_normal((n, p))).astype(np.float32)


def spread_of(x: np.ndarray) -> float:
    return float(np.linalg.norm(x - x.mean(axis=0), axis=1).max())


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("name", sorted(RULES))
@FAST
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e3, 1e6, 1e12]))
def test_one_huge_update_moves_the_result_by_a_bounded_amount(name, seed, scale) -> None:
    # Prepare: 11 honest updates; then the same buffer with one replaced by a huge vector.
    x = honest(seed)
    rng = np.random.default_rng(seed + 1)
    attacked = x.copy()
    attacked[3] = scale * rng.standard_normal(x.shape[1]).astype(np.float32)

    # Execute
    clean, dirty = aggregate(name, x), aggregate(name, attacked)

    # Assert: the move is at the scale of the honest spread, never of the attack.
    bound = 3.0 * spread_of(x) + 0.5 * float(np.linalg.norm(x, axis=1).max())
    assert np.all(np.isfinite(dirty))
    assert np.linalg.norm(dirty - clean) <= bound
    # ... whereas the plain mean follows the attacker.
    assert np.linalg.norm(attacked.mean(axis=0) - x.mean(axis=0)) > 10 * bound


@pytest.mark.parametrize("name", sorted(RULES))
@FAST
@given(seed=st.integers(0, 2**16))
def test_without_attackers_the_result_stays_near_the_mean_for_symmetric_data(name, seed) -> None:
    # Prepare: pairs mu +/- d_i around mu (coordinate-wise symmetric), plus mu itself.
    rng = np.random.default_rng(seed)
    p = 30
    mu = rng.standard_normal(p).astype(np.float32)
    d = 0.1 * rng.standard_normal((5, p)).astype(np.float32)
    x = np.concatenate([mu[None], mu + d, mu - d])

    # Execute
    out = aggregate(name, x)

    # Assert: Krum returns one update, the others average (nearly) all of them.
    tolerance = spread_of(x) if name == "krum" else 0.35 * spread_of(x)
    assert np.linalg.norm(out - x.mean(axis=0)) <= tolerance
    if name in ("median", "trimmed-mean", "clip", "centered-clip"):
        np.testing.assert_allclose(out, mu, atol=1e-5)


@pytest.mark.parametrize("name", sorted(RULES))
@FAST
@given(seed=st.integers(0, 2**16), perm_seed=st.integers(0, 2**16))
def test_the_order_of_arrival_does_not_matter(name, seed, perm_seed) -> None:
    x = honest(seed, n=9)
    w = np.random.default_rng(seed).integers(1, 50, size=9).astype(float)
    perm = np.random.default_rng(perm_seed).permutation(9)

    np.testing.assert_allclose(aggregate(name, x[perm], w[perm]), aggregate(name, x, w),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(RULES))
def test_non_finite_updates_are_dropped_not_averaged(name) -> None:
    x = honest(0, n=12)
    bad = x.copy()
    bad[0, 5] = np.nan
    bad[1, 7] = np.inf
    out = aggregate(name, bad)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, aggregate(name, x[2:]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(RULES))
def test_result_twice_gives_the_same_answer_and_reset_empties_the_buffer(name) -> None:
    agg = create_aggregator(name, 40, **RULES[name])
    for u in honest(1):
        agg.add(u, 1.0)
    first, second = agg.result(), agg.result()
    np.testing.assert_array_equal(first, second)
    agg.reset()
    assert agg.count == 0
    with pytest.raises(AggregationError, match="no updates"):
        agg.result()


@pytest.mark.parametrize("name", sorted(RULES))
def test_combine_on_a_given_stack_matches_streaming_the_same_updates(name) -> None:
    x = honest(10, n=9)
    w, f = np.arange(1.0, 10.0), np.linspace(0.5, 1.0, 9)
    direct = create_aggregator(name, x.shape[1], **RULES[name])
    out = direct.combine(x, w, f, [f"c{i}" for i in range(9)])
    np.testing.assert_allclose(out, aggregate(name, x, w, f), rtol=1e-5, atol=1e-6)


def test_a_reused_buffer_only_sees_the_current_round() -> None:
    agg = create_aggregator("median", 3)
    for _ in range(20):  # grows the buffer past its first capacity
        agg.add(np.full(3, 100.0, np.float32), 1.0)
    agg.result()
    agg.reset()
    for v in (1.0, 2.0, 3.0):
        agg.add(np.full(3, v, np.float32), 1.0)
    assert agg.count == 3
    np.testing.assert_allclose(agg.result(), 2.0)


# ----------------------------------------------------------------------------- rule specifics


def test_clip_without_clipping_is_exactly_fedavg_with_staleness_factors() -> None:
    x = honest(2)
    w = np.arange(1, 12, dtype=float)
    f = np.linspace(0.3, 1.0, 11)
    ref = WeightedMean(x.shape[1])
    for u, wi, fi in zip(x, w, f, strict=True):
        ref.add(u, wi, factor=fi)
    out = aggregate("clip", x, w, f, multiplier=100.0)
    np.testing.assert_allclose(out, ref.result(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["clip", "centered-clip", "multi-krum", "sybil-cclip"])
def test_claiming_a_huge_example_count_does_not_buy_the_result(name) -> None:
    # Prepare: 10 honest updates with 10 examples each; one attacker claims 1e9 examples.
    x = honest(9, n=11)
    x[0] = -100.0 * x[1:].mean(axis=0)
    w = np.full(11, 10.0)
    w[0] = 1e9

    # Execute
    out = aggregate(name, x, w)
    uncapped = aggregate(name, x, w, weight_cap=None)

    # Assert: capped at 4x the median count, the attacker weighs like 4 honest clients, and
    # clipping bounds what each of those counts buys; uncapped, it owns the result.
    mean = x[1:].mean(axis=0)
    assert np.linalg.norm(out - mean) <= 1.0 * np.linalg.norm(mean)
    if name != "multi-krum":  # Multi-Krum drops the attacker whatever its weight
        assert np.linalg.norm(uncapped - mean) > 2.0 * np.linalg.norm(mean)


@pytest.mark.parametrize("name", ["median", "default"])
def test_voting_rules_ignore_claimed_example_counts(name) -> None:
    x = honest(9, n=11)
    x[0] = -100.0 * x[1:].mean(axis=0)
    w = np.full(11, 10.0)
    claimed = w.copy()
    claimed[0] = 1e9
    np.testing.assert_array_equal(aggregate(name, x, claimed), aggregate(name, x, w))


def test_cap_weights_limits_each_weight_to_a_multiple_of_the_median() -> None:
    w = np.array([1.0, 2.0, 3.0, 1e9, 0.0])
    np.testing.assert_allclose(robust.cap_weights(w, ratio=4.0), [1, 2, 3, 10, 0])
    np.testing.assert_array_equal(robust.cap_weights(w, ratio=None), w)


def test_clip_bounds_each_update_to_multiplier_times_median_norm() -> None:
    x = np.zeros((5, 3), dtype=np.float32)
    x[:, 0] = [1, 1, 1, 1, 100]  # median norm 1; the last one is clipped to 2
    out = aggregate("clip", x, multiplier=2.0)
    np.testing.assert_allclose(out, [(4 + 2) / 5, 0, 0], rtol=1e-6)


def test_clip_window_keeps_a_running_median_across_rounds() -> None:
    agg = create_aggregator("clip", 1, multiplier=1.0, window=3)
    for norm in (1.0, 1.0, 1000.0):  # one round in which every update is huge
        agg.reset()
        for _ in range(3):
            agg.add(np.array([norm], np.float32), 1.0)
        out = agg.result()
    # bound = median(1, 1, 1000) = 1, so the huge round moves the model by 1, not 1000
    np.testing.assert_allclose(out, [1.0])


def test_staleness_factor_scales_the_update_before_the_statistic() -> None:
    x = np.ones((5, 4), dtype=np.float32)
    out = aggregate("median", x, factors=np.array([0.5, 0.5, 0.5, 1, 1]))
    np.testing.assert_allclose(out, 0.5)


def test_krum_returns_an_honest_update_when_f_attackers_collude() -> None:
    x = honest(3, n=9)
    x[:2] = 50.0  # two identical attackers: close to each other, far from everyone else
    out = aggregate("krum", x, f=2)
    assert any(np.array_equal(out, u) for u in x[2:])


def test_multi_krum_averages_the_m_best_scored_updates() -> None:
    x = honest(4, n=9)
    x[0] = 1e4
    agg = create_aggregator("multi-krum", x.shape[1], f=1, m=4)
    for u in x:
        agg.add(u, 1.0)
    sel = agg.selected(x)
    assert 0 not in sel and len(sel) == 4
    np.testing.assert_allclose(agg.result(), x[sel].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_trimmed_mean_matches_a_sort_based_reference() -> None:
    x = honest(5, n=10, p=robust_stats._BLOCK + 37)  # more than one column block
    out = robust.trimmed_mean(x, trim_count=2)
    ref = np.sort(x, axis=0)[2:-2].mean(axis=0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_coordinate_median_matches_numpy_for_odd_and_even_n() -> None:
    for n in (7, 8):
        x = honest(6, n=n, p=robust_stats._BLOCK + 5)
        np.testing.assert_allclose(robust.coordinate_median(x), np.median(x, axis=0), rtol=1e-6)


def test_gram_distances_match_direct_ones_even_beside_a_huge_row() -> None:
    x = honest(7, n=6, p=50)
    x[0] *= 1e15
    d2 = robust.pairwise_sq_distances(x)
    direct = ((x[1:, None, :].astype(np.float64) - x[None, 1:, :]) ** 2).sum(-1)
    np.testing.assert_allclose(d2[1:, 1:], direct, rtol=1e-3, atol=1e-3)
    assert np.all(d2[0, 1:] > 1e20)


def test_weighted_median_is_the_lower_median_by_weight() -> None:
    assert robust.weighted_median(np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 5.0])) == 3.0
    assert robust.weighted_median(np.array([1.0, 2.0, 3.0, 4.0]), np.ones(4)) == 2.0


def test_centered_clip_moves_at_most_tau_per_iteration_whatever_the_attacker_sends() -> None:
    x = np.zeros((10, 5), dtype=np.float32)
    x[0] = 1e9
    out, tau = robust.centered_clip(x, np.ones(10), centre=np.zeros(5, np.float32), tau=1.0,
                                    tau_scale=2.0, iterations=3)
    assert tau == 1.0
    assert np.linalg.norm(out) <= 3 * 1.0 / 10 + 1e-6


def test_centered_clip_distances_stay_exact_for_updates_next_to_the_centre() -> None:
    rng = np.random.default_rng(11)
    centre = rng.standard_normal(5000).astype(np.float32)
    x = (centre + 1e-4 * rng.standard_normal((6, 5000))).astype(np.float32)
    x[0] = 3 * centre  # one row far away takes the fast path

    got = robust_stats._distances_to(torch.from_numpy(x), centre, np.ones(6), robust.row_norms(x))
    want = np.linalg.norm(x.astype(np.float64) - centre, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_centered_clip_keeps_its_centre_across_reset() -> None:
    agg = create_aggregator("centered-clip", 3, tau=0.5, iterations=1)
    target = np.array([10.0, 0.0, 0.0], np.float32)
    steps = []
    for _ in range(3):
        for _ in range(4):
            agg.add(target, 1.0)
        steps.append(agg.result())
        agg.result()  # a second call must not move the centre again
        agg.reset()
    # starting at 0, each round moves the centre by tau toward the updates
    np.testing.assert_allclose([s[0] for s in steps], [0.5, 1.0, 1.5], rtol=1e-6)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("name", "options"), [
    ("clip", {"multiplier": 0.0}),
    ("clip", {"multiplier": float("nan")}),
    ("clip", {"window": 0}),
    ("trimmed-mean", {"trim": 0.0}),
    ("trimmed-mean", {"trim": 0.6}),
    ("krum", {"f": -1}),
    ("multi-krum", {"f": 1.5}),
    ("multi-krum", {"m": 0}),
    ("centered-clip", {"tau": -1.0}),
    ("centered-clip", {"tau_scale": 0.0}),
    ("centered-clip", {"iterations": 0}),
    ("centered-clip", {"momentum": 1.0}),
    ("clip", {"weight_cap": 0.5}),
    ("multi-krum", {"weight_cap": float("inf")}),
])
def test_bad_options_are_refused_at_construction(name, options) -> None:
    with pytest.raises(AggregationError):
        create_aggregator(name, 10, **options)


@pytest.mark.parametrize(("name", "options", "n", "message"), [
    ("krum", {"f": 2}, 6, "needs more than 6 updates"),
    ("multi-krum", {"f": 1}, 4, "needs more than 4 updates"),
    ("multi-krum", {"f": 1, "m": 5}, 5, "could include a Byzantine"),
    ("trimmed-mean", {"trim": 0.1}, 5, "removes none"),
    ("trimmed-mean", {"trim": 0.5}, 4, "leaving nothing"),
])
def test_buffers_that_break_a_rule_are_refused_at_result(name, options, n, message) -> None:
    agg = create_aggregator(name, 4, **options)
    for u in honest(8, n=n, p=4):
        agg.add(u, 1.0)
    with pytest.raises(AggregationError, match=message):
        agg.result()


def test_every_rule_is_registered() -> None:
    from murmura.aggregation import available_aggregators

    assert set(RULES) <= set(available_aggregators())


def test_huber_mean_extra_rows_join_the_statistic_only() -> None:
    rng = np.random.default_rng(31)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    past = rng.standard_normal((6, 40)).astype(np.float32) + 3.0
    pick = np.array([4, 0, 2])
    got = robust.huber_mean(x, c=1.0, extra=past, extra_rows=pick)
    stacked = np.concatenate([x, past[pick]])
    expected = robust.huber_mean(stacked, c=1.0, rows=np.arange(5), stat_rows=np.arange(8))
    np.testing.assert_array_equal(got, expected)
    assert not np.allclose(got, robust.huber_mean(x, c=1.0))  # the extra rows moved the range
