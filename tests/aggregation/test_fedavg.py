"""Weighted mean, FedBuff, staleness functions and server optimizers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import (
    AggregationError,
    Constant,
    FedAdam,
    FedAvgM,
    FedAvgOpt,
    FedBuff,
    FedYogi,
    Hinge,
    Polynomial,
    StaleUpdateError,
    WeightedMean,
    create_aggregator,
    create_optimizer,
    staleness_function,
    weighted_mean,
)

updates_st = st.integers(min_value=1, max_value=8).flatmap(
    lambda n: st.tuples(
        st.lists(st.lists(st.floats(-100, 100, width=32), min_size=5, max_size=5),
                 min_size=n, max_size=n),
        st.lists(st.floats(0.5, 50), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(updates_st, st.randoms(use_true_random=False))
def test_weighted_mean_is_permutation_invariant(data, rnd) -> None:
    ups, ws = data
    vecs = [np.asarray(u, dtype=np.float32) for u in ups]
    order = list(range(len(vecs)))
    rnd.shuffle(order)
    a = weighted_mean(vecs, ws)
    b = weighted_mean([vecs[i] for i in order], [ws[i] for i in order])
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(updates_st)
def test_equal_weights_give_the_mean(data) -> None:
    ups, _ = data
    vecs = [np.asarray(u, dtype=np.float32) for u in ups]
    out = weighted_mean(vecs, [3.0] * len(vecs))
    np.testing.assert_allclose(out, np.mean(np.stack(vecs), axis=0, dtype=np.float64),
                               rtol=1e-5, atol=1e-4)


def test_weighted_mean_matches_the_formula(rng) -> None:
    vecs = [rng.normal(size=100).astype(np.float32) for _ in range(4)]
    ws = [1.0, 2.0, 3.0, 10.0]
    expected = sum(w * v.astype(np.float64) for w, v in zip(ws, vecs, strict=False)) / sum(ws)
    np.testing.assert_allclose(weighted_mean(vecs, ws), expected, rtol=1e-6, atol=1e-6)


def test_factor_scales_without_renormalising(rng) -> None:
    u = rng.normal(size=10).astype(np.float32)
    agg = WeightedMean(10)
    agg.add(u, 1.0, factor=0.5)
    agg.add(np.zeros(10, np.float32), 1.0)
    np.testing.assert_allclose(agg.result(), 0.25 * u, rtol=1e-6)


def test_streaming_accepts_read_only_wire_buffers() -> None:
    payload = np.arange(6, dtype="<f4").tobytes()
    agg = WeightedMean(6)
    agg.add(np.frombuffer(payload, dtype="<f4"), 2.0)
    np.testing.assert_array_equal(agg.result(), np.arange(6, dtype=np.float32))


def test_accumulator_memory_is_one_vector() -> None:
    agg = WeightedMean(1000)
    for _ in range(50):
        agg.add(np.ones(1000, np.float32), 1.0)
    assert agg._acc.nbytes == 4000 and agg.count == 50


@pytest.mark.parametrize("bad", [
    dict(update=np.ones(3, np.float32), weight=1.0),
    dict(update=np.ones(4, np.float32), weight=0.0),
    dict(update=np.ones(4, np.float32), weight=float("nan")),
    dict(update=np.ones(4, np.float32), weight=1.0, factor=-1.0),
])
def test_weighted_mean_refuses_bad_input(bad) -> None:
    agg = WeightedMean(4)
    with pytest.raises(AggregationError):
        agg.add(**bad)
    assert agg.count == 0


def test_empty_aggregate_is_an_error() -> None:
    with pytest.raises(AggregationError, match="no updates"):
        WeightedMean(3).result()


def test_registry_fails_loudly() -> None:
    with pytest.raises(AggregationError, match="unknown aggregator 'nope'"):
        create_aggregator("nope", 3)
    assert isinstance(create_aggregator("fedavg", 3), WeightedMean)


# -- staleness --------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [Constant(), Polynomial(0.5), Polynomial(2.0), Hinge(10, 4)])
def test_staleness_functions_start_at_one_and_never_increase(fn) -> None:
    values = [fn(t) for t in range(50)]
    assert values[0] == 1.0
    assert all(b <= a for a, b in zip(values, values[1:], strict=False))
    assert all(v > 0 for v in values)


def test_staleness_formulas() -> None:
    assert Polynomial(0.5)(3) == pytest.approx(0.5)
    assert Hinge(a=10, b=4)(4) == 1.0
    assert Hinge(a=10, b=4)(6) == pytest.approx(1 / 21)
    with pytest.raises(ValueError):
        Polynomial(0.5)(-1)
    with pytest.raises(ValueError, match="unknown staleness"):
        staleness_function("exp")


# -- FedBuff ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(updates_st)
def test_zero_staleness_fedbuff_with_k_equal_cohort_is_a_fedavg_round(data) -> None:
    ups, ws = data
    vecs = [np.asarray(u, dtype=np.float32) for u in ups]
    buf = FedBuff(5, buffer_size=len(vecs), max_staleness=3)
    full = [buf.add(v, w, 0) for v, w in zip(vecs, ws, strict=False)]
    assert full == [False] * (len(vecs) - 1) + [True]
    np.testing.assert_array_equal(buf.flush(), weighted_mean(vecs, ws))
    assert buf.count == 0


def test_fedbuff_discounts_stale_updates_and_refuses_too_stale() -> None:
    buf = FedBuff(2, buffer_size=2, max_staleness=3, staleness=Polynomial(1.0))
    buf.add(np.array([2.0, 2.0], np.float32), 1, 0)
    buf.add(np.array([4.0, 4.0], np.float32), 1, 1)  # weight 1/2
    np.testing.assert_allclose(buf.flush(), [(2 + 2) / 2, (2 + 2) / 2])
    with pytest.raises(StaleUpdateError, match="4 versions old; the limit is 3"):
        buf.add(np.ones(2, np.float32), 1, 4)
    assert buf.count == 0


def test_admit_counts_partials_and_a_refused_update_counts_nothing() -> None:
    buf = FedBuff(2, buffer_size=5, max_staleness=2, staleness=Polynomial(1.0))
    assert buf.admit(0, 3) == (1.0, False)           # a leaf's partial of three updates
    with pytest.raises(StaleUpdateError):
        buf.admit(3)
    with pytest.raises(AggregationError, match="count"):
        buf.admit(0, 0)
    assert buf.count == 3
    assert buf.admit(1, 2) == (0.5, True)
    assert buf.emptied() == 5 and buf.count == 0


# -- server optimizers ------------------------------------------------------------------------

def test_fedavg_optimizer_applies_the_mean_update() -> None:
    p = np.ones(3, np.float32)
    np.testing.assert_allclose(FedAvgOpt(lr=1.0).step(p, np.full(3, 0.5, np.float32)), 1.5)
    np.testing.assert_array_equal(p, 1.0)  # input untouched


def test_fedavgm_accumulates_momentum() -> None:
    opt = FedAvgM(lr=1.0, beta=0.5)
    p = np.zeros(2, np.float32)
    d = np.ones(2, np.float32)
    p = opt.step(p, d)  # m = 1
    p = opt.step(p, d)  # m = 1.5
    np.testing.assert_allclose(p, 2.5)


@pytest.mark.parametrize("cls", [FedAdam, FedYogi])
def test_adaptive_optimizers_match_reference_formulas(cls, rng) -> None:
    opt = cls(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    p = rng.normal(size=5).astype(np.float32)
    m = np.zeros(5)
    v = np.zeros(5)
    x = p.astype(np.float64)
    for _ in range(3):
        d = rng.normal(size=5).astype(np.float32)
        m = 0.9 * m + 0.1 * d
        if cls is FedAdam:
            v = 0.99 * v + 0.01 * d**2
        else:
            v = v - 0.01 * d**2 * np.sign(v - d**2)
        x = x + 0.1 * m / (np.sqrt(v) + 1e-3)
        p = opt.step(p, d)
    np.testing.assert_allclose(p, x, rtol=1e-4, atol=1e-5)


def test_optimizer_state_round_trips() -> None:
    a = create_optimizer("fedadam", lr=0.1)
    p = np.zeros(4, np.float32)
    d = np.arange(4, dtype=np.float32)
    a.step(p, d)
    b = create_optimizer("fedadam", lr=0.1)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.step(p, d), b.step(p, d))
    with pytest.raises(ValueError, match="unknown server optimizer"):
        create_optimizer("sgd2")
    with pytest.raises(ValueError):
        FedAvgOpt().load_state_dict({"m": np.zeros(2, np.float32)})
