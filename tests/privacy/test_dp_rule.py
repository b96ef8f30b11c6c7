"""The DP rule (aggregation/dp.py): clipping, the noise's standard deviation, uniform weights,
adaptive clipping, state. Pure: small arrays, fixed seeds, hypothesis for the clip bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from murmura.aggregation import AggregationError, WeightedMean, create_aggregator
from murmura.aggregation.dp import (
    CLIP_MARGIN,
    AdaptiveClip,
    DPMean,
    adaptive_clip_step,
    clip_to_norm,
    count_noise_for,
    delta_noise_multiplier,
    l2_norm,
)

finite32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)
vectors = arrays(np.float32, st.integers(1, 300), elements=finite32)
clips = st.floats(min_value=1e-3, max_value=1e3)


def dp(size: int = 4, *, clip: float = 1.0, z: float = 0.0, seed: int = 7, m: int = 1,
       adaptive: AdaptiveClip | None = None, exact: bool = False) -> DPMean:
    agg = DPMean(WeightedMean(size, exact=exact), clip=clip, noise_multiplier=z, seed=seed,
                 adaptive=adaptive)
    agg.expect(m, 0.1)
    return agg


# -- clipping ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(vectors, clips)
def test_a_clipped_update_never_exceeds_the_clip(update: np.ndarray, clip: float) -> None:
    clipped, norm = clip_to_norm(update, clip)
    assert clipped.dtype == np.float32 and clipped.shape == update.shape
    assert l2_norm(clipped) <= clip
    assert norm == pytest.approx(float(np.linalg.norm(update.astype(np.float64))), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(vectors, clips)
def test_clipping_keeps_the_direction(update: np.ndarray, clip: float) -> None:
    clipped, norm = clip_to_norm(update, clip)
    if norm <= clip:
        assert clipped is update  # a no-op: the same array, untouched
        return
    u, c = update.astype(np.float64), clipped.astype(np.float64)
    # c = s u for one s > 0, up to float32 rounding (relative 2**-24; subnormals: 2**-150)
    s = clip / norm * (1 - CLIP_MARGIN)
    np.testing.assert_allclose(c, s * u, rtol=2.0 ** -23, atol=2.0 ** -149)
    assert l2_norm(clipped) == pytest.approx(clip, rel=1e-5)


def test_clipping_refuses_nonfinite_values_and_bad_clips() -> None:
    with pytest.raises(AggregationError, match="NaN or inf"):
        clip_to_norm(np.array([1.0, np.nan], np.float32), 1.0)
    with pytest.raises(AggregationError, match="overflows"):
        clip_to_norm(np.full(4, np.inf, np.float32), 1.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(AggregationError, match="clip must be positive"):
            clip_to_norm(np.ones(2, np.float32), bad)


def test_the_norm_is_accurate_over_many_blocks() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300_001).astype(np.float32)
    assert l2_norm(x) == pytest.approx(math.sqrt(float(np.sum(x.astype(np.float64) ** 2))),
                                       rel=1e-13)


# -- the mean: uniform weights, fixed denominator, one update per client -------------------


def test_clients_weigh_the_same_whatever_examples_they_claim() -> None:
    agg = dp(2, clip=10.0, m=2)
    agg.add(np.array([1.0, 0.0], np.float32), 1.0, client_id="a")
    agg.add(np.array([0.0, 1.0], np.float32), 1e6, client_id="b")  # an inflated count
    np.testing.assert_allclose(agg.result(), [0.5, 0.5])


def test_the_denominator_is_the_expected_count_not_the_arrivals() -> None:
    agg = dp(2, clip=10.0, m=4)  # four expected, two arrived
    agg.add(np.array([2.0, 0.0], np.float32), 1.0, client_id="a")
    agg.add(np.array([2.0, 4.0], np.float32), 1.0, client_id="b")
    np.testing.assert_allclose(agg.result(), [1.0, 1.0])


def test_each_update_is_clipped_and_staleness_only_shrinks_it() -> None:
    agg = dp(2, clip=1.0, m=2)
    agg.add(np.array([30.0, 40.0], np.float32), 1.0, client_id="a")          # norm 50 -> 1
    agg.add(np.array([0.0, 0.5], np.float32), 1.0, factor=0.5, client_id="b")
    np.testing.assert_allclose(agg.result(), [0.3, 0.4 + 0.125], rtol=1e-5)
    with pytest.raises(AggregationError, match="factor above 1"):
        agg.add(np.zeros(2, np.float32), 1.0, factor=1.5, client_id="c")


def test_a_second_update_of_a_client_in_one_aggregate_is_left_out() -> None:
    agg = dp(2, clip=10.0, m=1)
    agg.add(np.array([1.0, 1.0], np.float32), 1.0, client_id="a")
    agg.add(np.array([5.0, 5.0], np.float32), 1.0, client_id="a")
    assert agg.count == 2
    np.testing.assert_allclose(agg.result(), [1.0, 1.0])
    agg.reset()
    assert agg.last is not None and agg.last.skipped == 1 and agg.last.contributions == 1
    agg.add(np.array([5.0, 5.0], np.float32), 1.0, client_id="a")  # a new aggregate: counted
    np.testing.assert_allclose(agg.result(), [5.0, 5.0])


def test_robust_rules_are_refused_by_name() -> None:
    with pytest.raises(AggregationError, match="decomposable rule \\(fedavg\\); rule 'median'"):
        DPMean(create_aggregator("median", 4), clip=1.0, noise_multiplier=1.0, seed=0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clip": 0.0}, "clip must be positive"),
    ({"noise_multiplier": -1.0}, "noise multiplier"),
    ({"seed": -3}, "seed"),
])
def test_bad_settings_are_refused(kwargs: dict[str, float], match: str) -> None:
    args = {"clip": 1.0, "noise_multiplier": 1.0, "seed": 0, **kwargs}
    with pytest.raises(AggregationError, match=match):
        DPMean(WeightedMean(4), **args)  # type: ignore[arg-type]
    agg = dp()
    with pytest.raises(AggregationError, match="sampling rate"):
        agg.expect(3, 1.5)
    with pytest.raises(AggregationError, match="expected contributions"):
        agg.expect(0, 0.5)


def test_the_exact_accumulator_gives_the_same_mean() -> None:
    rng = np.random.default_rng(3)
    updates = rng.standard_normal((5, 64)).astype(np.float32)
    results = []
    for exact in (False, True):
        agg = dp(64, clip=2.0, z=1.0, m=5, exact=exact)
        for i, u in enumerate(updates):
            agg.add(u, 1.0, client_id=str(i))
        results.append(agg.result())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


# -- the noise -------------------------------------------------------------------------------


def test_the_noise_has_the_stated_standard_deviation() -> None:
    """1e5 coordinates of noise on the mean: std z C / m within 1 %, mean 0 within 4 sigma."""
    size, clip, z, m = 100_000, 2.0, 1.3, 10
    agg = dp(size, clip=clip, z=z, m=m, seed=2024)
    update = np.zeros(size, np.float32)
    update[0] = 0.5  # one real update: the clipped sum is known exactly
    agg.add(update, 1.0, client_id="a")
    noise = agg.result().astype(np.float64)
    noise[0] -= 0.5 / m
    stated = z * clip / m
    assert float(np.std(noise)) == pytest.approx(stated, rel=0.01)
    assert abs(float(np.mean(noise))) < 4 * stated / math.sqrt(size)
    agg.reset()
    assert agg.last is not None and agg.last.noise_std == pytest.approx(stated)


def test_noise_is_seeded_by_run_seed_and_release() -> None:
    def first_two(seed: int) -> list[np.ndarray]:
        agg, out = dp(8, z=1.0, seed=seed), []
        for _ in range(2):
            agg.add(np.zeros(8, np.float32), 1.0, client_id="a")
            out.append(agg.result())
            np.testing.assert_array_equal(agg.result(), out[-1])  # same release, same noise
            agg.reset()
        return out

    a, b = first_two(5), first_two(5)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], a[1])  # the next release draws anew
    assert not np.array_equal(a[0], first_two(6)[0])


def test_without_noise_the_mean_is_exact() -> None:
    agg = dp(3, clip=100.0, z=0.0, m=2)
    agg.add(np.array([1.0, 2.0, 3.0], np.float32), 1.0, client_id="a")
    agg.add(np.array([3.0, 2.0, 1.0], np.float32), 1.0, client_id="b")
    np.testing.assert_array_equal(agg.result(), np.array([2.0, 2.0, 2.0], np.float32))


# -- adaptive clipping (Andrew et al. 2021) --------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.floats(0.05, 20.0), st.floats(0.01, 100.0))
def test_the_two_noises_compose_to_the_stated_multiplier(z: float, sigma_b: float) -> None:
    if not 2 * sigma_b > z * (1 + 1e-9):
        with pytest.raises(AggregationError, match="must exceed"):
            delta_noise_multiplier(z, sigma_b)
        return
    z_delta = delta_noise_multiplier(z, sigma_b)
    assert z_delta >= z
    assert z_delta ** -2 + (2 * sigma_b) ** -2 == pytest.approx(z ** -2, rel=1e-9)


def test_the_count_noise_default_is_the_papers_share_at_least_z() -> None:
    assert count_noise_for(100, 1.0) == 5.0           # m / 20
    assert count_noise_for(10, 2.0) == 2.0            # raised to z
    assert count_noise_for(10, 2.0, given=7.0) == 7.0
    assert delta_noise_multiplier(2.0, 2.0) == pytest.approx(2.0 / math.sqrt(0.75))
    assert delta_noise_multiplier(0.0, 1.0) == 0.0
    assert delta_noise_multiplier(1.5, math.inf) == 1.5


def test_the_geometric_clip_update() -> None:
    assert adaptive_clip_step(2.0, 0.5, 0.5, 0.2) == 2.0
    assert adaptive_clip_step(2.0, 0.9, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.08))
    assert adaptive_clip_step(2.0, 0.1, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.08))


def test_one_release_moves_the_clip_by_the_noised_share_below_it() -> None:
    rule = AdaptiveClip(target=0.5, lr=0.2, count_noise=1e-9)  # noise negligible
    agg = dp(2, clip=1.0, z=0.0, m=10, adaptive=rule)
    for i in range(10):  # 3 of 10 within the clip
        norm = 0.5 if i < 3 else 4.0
        agg.add(np.array([norm, 0.0], np.float32), 1.0, client_id=str(i))
    agg.result()
    agg.reset()
    assert agg.last is not None and agg.last.below_clip == pytest.approx(0.3, abs=1e-6)
    assert agg.clip == pytest.approx(math.exp(-0.2 * (0.3 - 0.5)), rel=1e-6)


def test_the_adaptive_clip_tracks_the_target_quantile() -> None:
    """Norms uniform on [0, 2]: the median is 1, the 0.8-quantile 1.6; 100 clients a round."""
    rng = np.random.default_rng(11)
    for target, quantile in ((0.5, 1.0), (0.8, 1.6)):
        agg = dp(1, clip=0.1, z=1.0, m=100, adaptive=AdaptiveClip(target, lr=0.2))
        clips = []
        for _ in range(300):
            for i, norm in enumerate(rng.uniform(0, 2, size=100)):
                agg.add(np.array([norm], np.float32), 1.0, client_id=str(i))
            agg.result()
            agg.reset()
            clips.append(agg.clip)
        assert float(np.mean(clips[-100:])) == pytest.approx(quantile, rel=0.05)


def test_adaptive_settings_are_checked() -> None:
    for bad in ({"target": 0.0}, {"target": 1.0}, {"target": 0.5, "lr": 0.0},
                {"target": 0.5, "count_noise": -1.0}):
        with pytest.raises(AggregationError):
            AdaptiveClip(**bad)  # type: ignore[arg-type]
    agg = dp(2, z=3.0, m=10, adaptive=AdaptiveClip(0.5, count_noise=1.0))  # 2 sigma_b < z
    agg.add(np.ones(2, np.float32), 1.0)
    with pytest.raises(AggregationError, match="must exceed half"):
        agg.result()


# -- the ledger and state -----------------------------------------------------------------


def test_the_ledger_counts_releases_in_runs_and_survives_a_restart() -> None:
    agg = dp(2, z=1.5, adaptive=AdaptiveClip(0.5))
    for q in (0.1, 0.1, 0.2):
        agg.expect(1, q)
        agg.add(np.ones(2, np.float32), 1.0)
        agg.result()
        agg.reset()
    agg.reset()  # a reset without a result releases nothing
    assert agg.ledger == [(0.1, 1.5, 2), (0.2, 1.5, 1)] and agg.releases == 3
    again = dp(2, z=1.5, adaptive=AdaptiveClip(0.5))
    again.load_state_dict(agg.state_dict())
    assert again.ledger == agg.ledger and again.releases == 3 and again.clip == agg.clip
    with pytest.raises(AggregationError, match="lacks"):
        again.load_state_dict({"clip": np.array([1.0])})
    bad = {**agg.state_dict(), "releases": np.array([7])}
    with pytest.raises(AggregationError, match="inconsistent"):
        again.load_state_dict(bad)
