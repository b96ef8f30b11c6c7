"""Mergeable partial aggregates: the exact sum's order independence and exactness, the
weighted mean's partial()/merge() in both modes, and the stated float32 tolerances."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import (
    AggregationError,
    ExactSum,
    Partial,
    WeightedMean,
    available_aggregators,
    create_aggregator,
)
from murmura.aggregation.exact_sum import _to_float64
from murmura.aggregation.partial import EXACT_LIMIT, LIMB_BITS, QUANTUM_BITS

SIZE = 5
U32 = 2.0**-24  # float32 unit roundoff
F32 = npt.NDArray[np.float32]
Contribution = tuple[F32, float, float]  # (update, weight, factor)


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u) for float32."""
    return k * U32 / (1 - k * U32)


def _vector(values: list[float]) -> F32:
    return np.array(values, dtype=np.float32)


# Any finite float32, subnormals included; weights and factors as the aggregators take them.
any_f32 = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False)
contributions_st = st.lists(
    st.tuples(st.lists(any_f32, min_size=SIZE, max_size=SIZE).map(_vector),
              st.floats(0.001, 1e4), st.floats(0, 1)),
    min_size=1, max_size=10)

# Contributions that lie on the 2**-80 grid: integer weights, short dyadic factors, float32
# values of magnitude >= 2**-50 (or zero): w f u has at most 40 significant bits, the lowest
# of weight >= 2**-76.
grid_f32 = any_f32.map(lambda x: x if abs(x) >= 2.0**-50 else 0.0)
grid_contributions_st = st.lists(
    st.tuples(st.lists(grid_f32, min_size=SIZE, max_size=SIZE).map(_vector),
              st.integers(1, 10_000).map(float),
              st.sampled_from([1.0, 0.5, 0.25, 0.75, 0.125])),
    min_size=1, max_size=10)

# Well-scaled updates (no float32 subnormals) for the float32-tolerance properties.
normal_f32 = st.one_of(st.just(0.0), st.floats(1e-20, 1e4), st.floats(-1e4, -1e-20)).map(
    lambda x: float(np.float32(x)))
normal_contributions_st = st.lists(
    st.tuples(st.lists(normal_f32, min_size=SIZE, max_size=SIZE).map(_vector),
              st.floats(1, 1000), st.floats(0.01, 1)),
    min_size=1, max_size=12)


def _flat(contribs: list[Contribution]) -> ExactSum:
    total = ExactSum(SIZE)
    for u, w, f in contribs:
        total.add(u, w, factor=f)
    return total


def _tree(contribs: list[Contribution], rnd: random.Random) -> ExactSum:
    """The same contributions in a random order, cut into random groups, merged pairwise in a
    random order (any shape of aggregation tree)."""
    order = list(range(len(contribs)))
    rnd.shuffle(order)
    sums, i = [], 0
    while i < len(order):
        k = rnd.randint(1, len(order) - i)
        sums.append(_flat([contribs[j] for j in order[i : i + k]]))
        i += k
    while len(sums) > 1:
        a = sums.pop(rnd.randrange(len(sums)))
        b = sums.pop(rnd.randrange(len(sums)))
        a.merge(b)
        sums.append(a)
    return sums[0]


def _integers(total: ExactSum) -> list[int]:
    hi, lo = total.limbs()
    return [int(h) * (1 << LIMB_BITS) + int(x) for h, x in zip(hi, lo, strict=True)]


def _reference(contribs: list[Contribution]) -> list[int]:
    """sum_i RNE(c_i * 2**80) in Python integers, c_i = float64(w * f) * float64(u_i)."""
    return [sum(round(Fraction(float(w * f) * float(u[j])) * (1 << QUANTUM_BITS))
                for u, w, f in contribs) for j in range(SIZE)]


# -- ExactSum: order independence and exactness ------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(contributions_st, st.randoms(use_true_random=False))
def test_exact_sum_is_bit_identical_for_any_order_and_merge_tree(contribs, rnd) -> None:
    # Prepare / Execute
    flat, tree = _flat(contribs), _tree(contribs, rnd)

    # Assert: the same integers, hence the same float64 values, weight and count
    assert _integers(flat) == _integers(tree) == _reference(contribs)
    np.testing.assert_array_equal(flat.value(), tree.value())
    assert flat.value().tobytes() == tree.value().tobytes()  # signed zeros too
    assert flat.total_weight == tree.total_weight == sum(Fraction(w) for _, w, _ in contribs)
    assert flat.count == tree.count == len(contribs)


@settings(max_examples=80, deadline=None)
@given(grid_contributions_st)
def test_on_the_grid_the_value_equals_math_fsum_exactly(contribs) -> None:
    total = _flat(contribs)
    expected = [math.fsum(float(w * f) * float(u[j]) for u, w, f in contribs)
                for j in range(SIZE)]
    assert total.value().tolist() == expected


@settings(max_examples=80, deadline=None)
@given(contributions_st)
def test_off_the_grid_the_value_is_within_the_stated_bound_of_math_fsum(contribs) -> None:
    # Each contribution is rounded to 2**-80 (<= 2**-81 off), then value() rounds once.
    value = _flat(contribs).value()
    for j in range(SIZE):
        exact = math.fsum(float(w * f) * float(u[j]) for u, w, f in contribs)
        bound = len(contribs) * 2.0**-81 + 2.0**-52 * abs(exact)
        assert abs(value[j] - exact) <= bound


@settings(max_examples=300, deadline=None)
@given(st.integers(-(1 << 62) + 1, (1 << 62) - 1), st.integers(0, (1 << 60) - 1))
def test_value_is_the_correctly_rounded_float64_of_the_integers(hi: int, lo: int) -> None:
    got = _to_float64(np.array([hi], dtype=np.int64), np.array([lo], dtype=np.int64))
    assert got[0] == float(Fraction(hi * (1 << 60) + lo, 1 << 80))


@pytest.mark.parametrize(("hi", "lo"), [
    (0, (1 << 53) + 1),  # a tie below 2**-26: to even (down)
    (0, (1 << 53) + 3),  # a tie: to even (up)
    (2, (1 << 8)),  # 2**61 + 2**8: a tie at 2**61, to even
    (2, (1 << 8) + 1),  # just above the tie: up
    (1 << 40, 1 << 47),  # 2**100 + 2**47: a tie once 38 bits are dropped
    (1 << 40, (1 << 47) + 1),  # the dropped bits make it round up (the sticky bit)
    ((1 << 62) - 1, (1 << 60) - 1),  # the largest magnitude
    (-1, 0), (-1, 1), (-(1 << 40), 1 << 47), (-(1 << 40) - 1, (1 << 47) - 1),
    (-(1 << 62) + 1, 0), (0, 0),
])
def test_value_rounds_ties_to_even_and_keeps_sticky_bits(hi: int, lo: int) -> None:
    got = _to_float64(np.array([hi], dtype=np.int64), np.array([lo], dtype=np.int64))
    assert got[0] == float(Fraction(hi * (1 << 60) + lo, 1 << 80))


def test_large_sums_near_the_limit_stay_exact() -> None:
    total = ExactSum(2)
    big = np.array([2.0**40, -(2.0**40)], dtype=np.float32)
    for _ in range(3):
        total.add(big, 1.0)
    total.add(np.array([2.0**-50, 1.0], dtype=np.float32), 1.0)
    assert total.value().tolist() == [3 * 2.0**40 + 2.0**-50, -3 * 2.0**40 + 1.0]


# -- ExactSum: refusals ------------------------------------------------------------------------


def _state(total: ExactSum) -> tuple[bytes, bytes, int, Fraction]:
    hi, lo = total.limbs()
    return hi.tobytes(), lo.tobytes(), total.count, total.total_weight


def test_overflow_is_refused_and_changes_nothing() -> None:
    # Prepare: each add books floor(2**40 * 2**20) + 1 = 2**60 + 1 of the 2**62 range
    total = ExactSum(3)
    update = np.array([2.0**40, 1.0, -1.0], dtype=np.float32)
    for _ in range(3):
        total.add(update, 1.0)
    before = _state(total)

    # Execute / Assert
    with pytest.raises(AggregationError, match=r"overflow.*2\*\*42"):
        total.add(update, 1.0)
    with pytest.raises(AggregationError, match="overflow"):
        ExactSum(3).add(np.array([0, 0, 2.0**42], dtype=np.float32), 1.0)
    with pytest.raises(AggregationError, match="overflow"):
        ExactSum(3).add(np.ones(3, dtype=np.float32), 2.0**30, factor=2.0**13)
    assert _state(total) == before


def test_merge_overflow_is_refused_and_changes_nothing() -> None:
    a, b = ExactSum(2), ExactSum(2)
    a.add(np.array([2.0**41, 0], dtype=np.float32), 1.0)
    b.add(np.array([2.0**41, 0], dtype=np.float32), 1.0)
    before = _state(a), _state(b)
    with pytest.raises(AggregationError, match="overflow"):
        a.merge(b)
    assert (_state(a), _state(b)) == before


@pytest.mark.parametrize(("update", "weight", "factor", "match"), [
    (np.array([1, np.nan, 0], dtype=np.float32), 1.0, 1.0, "NaN or Inf"),
    (np.array([1, np.inf, 0], dtype=np.float32), 1.0, 1.0, "NaN or Inf"),
    (np.array([-np.inf, 0, 0], dtype=np.float32), 1.0, 1.0, "NaN or Inf"),
    (np.ones(3, dtype=np.float32), 1e308, 1e10, "overflows float64"),
    (np.ones(3, dtype=np.float32), 0.0, 1.0, "weight"),
    (np.ones(3, dtype=np.float32), math.nan, 1.0, "weight"),
    (np.ones(3, dtype=np.float32), 1.0, -0.5, "factor"),
    (np.ones(3, dtype=np.float32), 1.0, math.inf, "factor"),
    (np.ones(4, dtype=np.float32), 1.0, 1.0, "shape"),
])
def test_bad_contributions_are_refused_and_change_nothing(update, weight, factor,
                                                          match) -> None:
    total = ExactSum(3)
    total.add(np.array([1, 2, 3], dtype=np.float32), 2.0)
    before = _state(total)
    with pytest.raises(AggregationError, match=match):
        total.add(update, weight, factor=factor)
    assert _state(total) == before


def test_merge_refuses_other_sizes_and_types() -> None:
    with pytest.raises(AggregationError, match="4 values, expected 3"):
        ExactSum(3).merge(ExactSum(4))
    with pytest.raises(AggregationError, match="ExactSum"):
        ExactSum(3).merge(np.zeros(3))  # type: ignore[arg-type]


# -- ExactSum: scaling, limbs, reset -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(contributions_st, st.floats(0, 4))
def test_scaling_is_within_six_quanta_of_the_exact_product(contribs, factor: float) -> None:
    total = _flat(contribs)
    scaled = total.scaled(factor)
    for got, n in zip(_integers(scaled), _integers(total), strict=True):
        assert abs(got - Fraction(factor) * n) <= 6
    assert scaled.count == total.count and scaled.total_weight == total.total_weight


@settings(max_examples=60, deadline=None)
@given(grid_contributions_st, st.sampled_from([1.0, 0.5, 0.25, 0.75, 0.375, 2.0, 0.0]))
def test_scaling_by_short_dyadic_factors_is_exact(contribs, factor: float) -> None:
    total = _flat(contribs)
    assert _integers(total.scaled(factor)) == [Fraction(factor) * n for n in _integers(total)]


def test_scaling_refuses_overflow_and_bad_factors() -> None:
    total = ExactSum(2)
    total.add(np.array([2.0**40, 1], dtype=np.float32), 1.0)
    with pytest.raises(AggregationError, match="overflow"):
        total.scaled(8.0)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(AggregationError, match="factor"):
            total.scaled(bad)


def test_limbs_round_trip_and_are_read_only(rng) -> None:
    total = ExactSum(100)
    for _ in range(7):  # 7 folds: some carries are still pending before limbs()
        total.add(rng.normal(size=100).astype(np.float32), float(rng.integers(1, 50)),
                  factor=float(rng.uniform()))
    hi, lo = total.limbs()
    assert not hi.flags.writeable and not lo.flags.writeable
    assert lo.min() >= 0 and lo.max() < 1 << LIMB_BITS
    rebuilt = ExactSum.from_limbs(hi, lo, weight=total.total_weight, count=total.count)
    assert rebuilt.value().tobytes() == total.value().tobytes()
    assert rebuilt.total_weight == total.total_weight and rebuilt.count == total.count


@pytest.mark.parametrize(("hi", "lo", "match"), [
    ([0, 0], [0, -1], "lo limb 1 is -1"),
    ([0, 0], [1 << 60, 0], "lo limb 0"),
    ([1 << 62, 0], [0, 0], "range"),
    ([-(1 << 62), 0], [0, 0], "range"),
    ([0, 0], [0], "shapes"),
    ([[0]], [[0]], "shapes"),
    ([0.0, 1.0], [0, 0], "int64"),
])
def test_from_limbs_refuses_malformed_limbs(hi, lo, match) -> None:
    with pytest.raises(AggregationError, match=match):
        ExactSum.from_limbs(np.array(hi), np.array(lo), weight=1.0, count=1)


@pytest.mark.parametrize(("weight", "count", "match"), [
    (-1.0, 1, "weight"), (math.nan, 1, "weight"), (1.0, -1, "count"), (1.0, 1.5, "count"),
])
def test_from_limbs_refuses_bad_scalars(weight, count, match) -> None:
    with pytest.raises(AggregationError, match=match):
        ExactSum.from_limbs(np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64),
                            weight=weight, count=count)


def test_reset_forgets_everything() -> None:
    total = ExactSum(3)
    total.add(np.array([1, 2, 3], dtype=np.float32), 4.0)
    total.reset()
    assert total.count == 0 and total.total_weight == 0 and not total.value().any()
    total.add(np.array([1, 2, 3], dtype=np.float32), 1.0)
    assert total.value().tolist() == [1, 2, 3]


# -- WeightedMean: partial() and merge() -------------------------------------------------------


def _leaf(contribs: list[Contribution], *, exact: bool) -> Partial:
    agg = WeightedMean(SIZE, exact=exact)
    for u, w, f in contribs:
        agg.add(u, w, factor=f)
    return agg.partial()


def _groups(contribs: list[Contribution], k: int, rnd: random.Random) -> list[list[Contribution]]:
    """``contribs`` shuffled and dealt into k non-empty groups (fewer if there are fewer)."""
    shuffled = list(contribs)
    rnd.shuffle(shuffled)
    k = min(k, len(shuffled))
    groups: list[list[Contribution]] = [[] for _ in range(k)]
    for i, c in enumerate(shuffled):
        groups[i % k if i < k else rnd.randrange(k)].append(c)
    return groups


@settings(max_examples=60, deadline=None)
@given(contributions_st, st.randoms(use_true_random=False))
def test_exact_weighted_mean_is_bit_identical_for_1_2_4_partials_in_any_order(contribs,
                                                                            rnd) -> None:
    # Prepare: the flat run
    flat = WeightedMean(SIZE, exact=True)
    for u, w, f in contribs:
        flat.add(u, w, factor=f)
    expected = flat.result()

    for k in (1, 2, 4):
        # Execute: leaves fold shuffled groups, the parent merges them in a random order
        partials = [_leaf(g, exact=True) for g in _groups(contribs, k, rnd)]
        rnd.shuffle(partials)
        parent = WeightedMean(SIZE, exact=True)
        for p in partials:
            parent.merge(p)

        # Assert
        assert parent.result().tobytes() == expected.tobytes()
        assert parent.count == flat.count and parent.total_weight == flat.total_weight


def _three_levels(clients: list[Contribution], size: int, *, exact: bool) -> WeightedMean:
    """4 leaves of 6 clients (each in reverse), 2 mid-level aggregators of 2 leaves, a root."""
    leaves = []
    for i in range(4):
        leaf = WeightedMean(size, exact=exact)
        for u, w, f in clients[i * 6 : (i + 1) * 6][::-1]:
            leaf.add(u, w, factor=f)
        leaves.append(leaf.partial())
    mids = []
    for pair in ((leaves[3], leaves[0]), (leaves[2], leaves[1])):
        mid = WeightedMean(size, exact=exact)
        for p in pair:
            mid.merge(p)
        mids.append(mid.partial())
    root = WeightedMean(size, exact=exact)
    root.merge(mids[1])
    root.merge(mids[0])
    return root


def test_a_three_level_hierarchy_publishes_exactly_the_flat_model(rng) -> None:
    # Prepare: 24 clients whose updates span 8 orders of magnitude
    size = 1000
    clients = [(rng.normal(scale=10.0 ** rng.integers(-6, 2), size=size).astype(np.float32),
                float(rng.integers(1, 500)), float(rng.uniform(0.2, 1))) for _ in range(24)]
    flat = {exact: WeightedMean(size, exact=exact) for exact in (False, True)}
    for agg in flat.values():
        for u, w, f in clients:
            agg.add(u, w, factor=f)

    # Execute
    root = {exact: _three_levels(clients, size, exact=exact) for exact in (False, True)}

    # Assert: exact is bit-identical; float32 is not (so the data does exercise rounding)
    assert root[True].result().tobytes() == flat[True].result().tobytes()
    assert root[True].count == 24 and root[True].total_weight == flat[True].total_weight
    assert (root[False].result() != flat[False].result()).sum() > 100


@settings(max_examples=60, deadline=None)
@given(normal_contributions_st)
def test_exact_weighted_mean_is_close_to_the_float32_one(contribs) -> None:
    # Tolerance: the float32 fold is within gamma(n + 1) sum|c| of the exact sum (w f rounded
    # to float32, the product, n - 1 additions); the division and the final float32 roundings
    # add at most 4u of the result; the exact path rounds each contribution to 2**-80 (below
    # 2**-57 that is coarser than float32: 2**-81 per contribution).
    fast, exact = WeightedMean(SIZE), WeightedMean(SIZE, exact=True)
    for u, w, f in contribs:
        fast.add(u, w, factor=f)
        exact.add(u, w, factor=f)
    total_w = sum(w for _, w, _ in contribs)
    magnitude = sum(w * f * np.abs(u.astype(np.float64)) for u, w, f in contribs) / total_w
    expected = exact.result().astype(np.float64)
    bound = (gamma(len(contribs) + 2) * magnitude + 4 * U32 * np.abs(expected)
             + len(contribs) * 2.0**-81 / total_w + 1e-38)
    assert np.all(np.abs(fast.result() - expected) <= bound)


@settings(max_examples=60, deadline=None)
@given(normal_contributions_st, st.randoms(use_true_random=False))
def test_float32_partials_merge_within_the_stated_tolerance(contribs, rnd) -> None:
    # Tolerance (Partial's docstring): any tree of adds, merges and scalings is within
    # gamma(n + 4) sum|c| of the exact sum, so two trees differ by at most twice that.
    exact = np.array([math.fsum(w * f * float(u[j]) for u, w, f in contribs)
                      for j in range(SIZE)])  # float64 products: 2**-52 off at most
    magnitude = sum(w * f * np.abs(u.astype(np.float64)) for u, w, f in contribs)
    bound = 2 * (gamma(len(contribs) + 4) + 2.0**-51) * magnitude + 1e-38
    sums = []
    for k in (1, 2, 4):
        partials = [_leaf(g, exact=False) for g in _groups(contribs, k, rnd)]
        rnd.shuffle(partials)
        merged = partials[0]
        for p in partials[1:]:
            merged = merged.merge(p) if rnd.random() < 0.5 else p.merge(merged)
        assert merged.count == len(contribs)
        sums.append(merged.sum.astype(np.float64))
    for s in sums:
        assert np.all(np.abs(s - exact) <= bound / 2)
        assert np.all(np.abs(s - sums[0]) <= bound)


@settings(max_examples=60, deadline=None)
@given(grid_contributions_st, st.sampled_from([1.0, 0.5, 0.25, 0.75, 0.125]))
def test_exact_merge_with_a_factor_equals_adding_with_that_factor(contribs, factor) -> None:
    # Prepare: one aggregator adds the updates with the factor, a leaf adds them without
    direct = WeightedMean(SIZE, exact=True)
    leaf = WeightedMean(SIZE, exact=True)
    for u, w, _ in contribs:
        direct.add(u, w, factor=factor)
        leaf.add(u, w)

    # Execute
    parent = WeightedMean(SIZE, exact=True)
    parent.merge(leaf.partial(), factor=factor)

    # Assert: the same integers, so the same model
    got, want = parent.partial(), direct.partial()
    assert isinstance(got.sum, ExactSum) and isinstance(want.sum, ExactSum)
    assert _integers(got.sum) == _integers(want.sum)
    assert parent.result().tobytes() == direct.result().tobytes()
    assert parent.count == direct.count and parent.total_weight == direct.total_weight


@settings(max_examples=60, deadline=None)
@given(contributions_st, st.floats(0, 1))
def test_exact_merge_with_any_factor_is_within_the_stated_bound(contribs, factor) -> None:
    # Off the grid, adding rounds w f and each product to float64 (2 roundings per
    # contribution) and each to the grid; scaling the leaf's sum rounds 12 products to the grid.
    direct, leaf = ExactSum(SIZE), ExactSum(SIZE)
    for u, w, _ in contribs:
        direct.add(u, w, factor=factor)
        leaf.add(u, w)
    merged = ExactSum(SIZE)
    merged.merge(leaf.scaled(factor))
    magnitude = sum(w * factor * np.abs(u.astype(np.float64)) for u, w, _ in contribs)
    want = direct.value()
    bound = (3 * 2.0**-53 * magnitude + (len(contribs) + 8) * 2.0**-80
             + 2.0**-52 * np.abs(want))
    assert np.all(np.abs(merged.value() - want) <= bound)


@settings(max_examples=60, deadline=None)
@given(normal_contributions_st, st.floats(0.01, 1))
def test_float32_merge_with_a_factor_is_within_tolerance_of_adding(contribs, factor) -> None:
    direct, leaf, parent = WeightedMean(SIZE), WeightedMean(SIZE), WeightedMean(SIZE)
    for u, w, f in contribs:
        direct.add(u, w, factor=f * factor)
        leaf.add(u, w, factor=f)
    parent.merge(leaf.partial(), factor=factor)
    magnitude = sum(w * f * factor * np.abs(u.astype(np.float64)) for u, w, f in contribs)
    bound = 2 * gamma(len(contribs) + 4) * magnitude + 1e-38
    got, want = parent.partial(), direct.partial()
    assert np.all(np.abs(got.sum.astype(np.float64) - want.sum) <= bound)
    assert got.count == want.count and got.weight == pytest.approx(want.weight, rel=1e-15)


def test_partial_is_a_copy_of_the_state(rng) -> None:
    for exact in (False, True):
        agg = WeightedMean(4, exact=exact)
        agg.add(np.array([1, 2, 3, 4], dtype=np.float32), 2.0)
        snapshot = agg.partial()
        mean = snapshot.mean()
        agg.add(np.array([9, 9, 9, 9], dtype=np.float32), 2.0)
        assert snapshot.count == 1 and snapshot.weight == 2
        np.testing.assert_array_equal(snapshot.mean(), mean)
        np.testing.assert_array_equal(mean, [1, 2, 3, 4])
        assert snapshot.exact == exact


def test_an_exact_partial_may_enter_a_float32_aggregator() -> None:
    leaf = WeightedMean(3, exact=True)
    leaf.add(np.array([1, 2, 3], dtype=np.float32), 2.0)
    parent = WeightedMean(3)
    parent.add(np.array([3, 2, 1], dtype=np.float32), 2.0)
    parent.merge(leaf.partial(), factor=0.5)
    np.testing.assert_allclose(parent.result(), [1.75, 1.5, 1.25], rtol=1e-6)
    assert parent.count == 2 and parent.total_weight == 4.0


def _bad_merges() -> list[tuple[bool, Partial, float, str]]:
    leaf32, leaf_x = WeightedMean(3), WeightedMean(3, exact=True)
    for leaf in (leaf32, leaf_x):
        leaf.add(np.ones(3, dtype=np.float32), 1.0)
    return [
        (True, leaf32.partial(), 1.0, "float32 partial cannot enter an exact"),
        (False, Partial.empty(3), 1.0, "empty"),
        (True, Partial.empty(3, exact=True), 1.0, "empty"),
        (False, Partial.empty(4), 1.0, "4 values, expected 3"),
        (False, leaf32.partial(), -1.0, "factor"),
        (True, leaf_x.partial(), math.nan, "factor"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_merges())))
def test_bad_merges_are_refused_and_change_nothing(case: int) -> None:
    exact, partial, factor, match = _bad_merges()[case]
    agg = WeightedMean(3, exact=exact)
    agg.add(np.array([1, 2, 3], dtype=np.float32), 2.0)
    before = agg.result().tobytes(), agg.count, agg.total_weight
    with pytest.raises(AggregationError, match=match):
        agg.merge(partial, factor=factor)
    assert (agg.result().tobytes(), agg.count, agg.total_weight) == before


def test_exact_merge_overflow_is_refused_and_changes_nothing() -> None:
    big = np.array([2.0**41, 0, 0], dtype=np.float32)
    leaf, agg = WeightedMean(3, exact=True), WeightedMean(3, exact=True)
    leaf.add(big, 1.0)
    agg.add(big, 1.0)
    before = agg.result().tobytes(), agg.count
    with pytest.raises(AggregationError, match="overflow"):
        agg.merge(leaf.partial())
    with pytest.raises(AggregationError, match="overflow"):
        agg.merge(leaf.partial(), factor=4.0)
    assert (agg.result().tobytes(), agg.count) == before


def test_exact_mode_keeps_the_aggregator_contract() -> None:
    agg = WeightedMean(3, exact=True)
    with pytest.raises(AggregationError, match="no updates"):
        agg.result()
    agg.add(np.array([1, 2, 3], dtype=np.float64), 1.0)  # other dtypes fold as float32
    agg.add(np.array([3, 2, 1], dtype=">f4"), 3.0)
    assert agg.result().dtype == np.float32
    np.testing.assert_array_equal(agg.result(), [2.5, 2.0, 1.5])
    assert agg.count == 2 and agg.total_weight == 4.0 and agg.exact
    agg.reset()
    assert agg.count == 0 and agg.total_weight == 0.0
    with pytest.raises(AggregationError, match="no updates"):
        agg.result()


def test_only_the_weighted_mean_is_decomposable() -> None:
    rules = {name: create_aggregator(name, 8) for name in available_aggregators()}
    assert {name for name, rule in rules.items() if rule.decomposable} == {"fedavg"}
    assert WeightedMean.decomposable and WeightedMean(8, exact=True).decomposable


# -- Partial -----------------------------------------------------------------------------------


def test_partial_operations_return_new_partials_and_leave_inputs_alone() -> None:
    for exact in (False, True):
        a = _leaf([(_vector([1, 2, 3, 4, 5]), 2.0, 1.0)], exact=exact)
        b = _leaf([(_vector([5, 4, 3, 2, 1]), 2.0, 1.0)], exact=exact)
        a_mean, b_mean = a.mean(), b.mean()
        merged, scaled = a.merge(b), a.scaled(0.5)
        np.testing.assert_array_equal(a.mean(), a_mean)
        np.testing.assert_array_equal(b.mean(), b_mean)
        np.testing.assert_array_equal(merged.mean(), [3, 3, 3, 3, 3])
        np.testing.assert_array_equal(scaled.mean(), a_mean / 2)
        assert merged.count == 2 and merged.weight == 4 and scaled.weight == 2
        empty = Partial.empty(SIZE, exact=exact)
        np.testing.assert_array_equal(empty.merge(a).mean(), a_mean)


def test_partials_of_different_kinds_or_sizes_do_not_merge() -> None:
    with pytest.raises(AggregationError, match="exact partial with a float32"):
        Partial.empty(3).merge(Partial.empty(3, exact=True))
    with pytest.raises(AggregationError, match="4 values, expected 3"):
        Partial.empty(3).merge(Partial.empty(4))
    with pytest.raises(AggregationError, match="no updates"):
        Partial.empty(3).mean()
    with pytest.raises(AggregationError, match="factor"):
        Partial.empty(3).scaled(-1.0)
    with pytest.raises(AggregationError, match="overflows float32"):
        Partial(np.full(3, 3e38, dtype=np.float32), 1.0, 1).scaled(2.0)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Partial(np.zeros(3, dtype=np.float64), 1.0, 1), "float32"),
    (lambda: Partial(np.zeros((1, 3), dtype=np.float32), 1.0, 1), "1-d"),
    (lambda: Partial(np.zeros(3, dtype=np.float32), -1.0, 1), "weight"),
    (lambda: Partial(np.zeros(3, dtype=np.float32), math.inf, 1), "weight"),
    (lambda: Partial(np.zeros(3, dtype=np.float32), 1.0, -1), "count"),
    (lambda: Partial(np.zeros(3, dtype=np.float32), 1.0, 0), "empty partial"),
    (lambda: Partial(np.zeros(3, dtype=np.float32), Fraction(1), 1), "Fraction"),
    (lambda: Partial(ExactSum(3), 0.0, 0), "Fraction"),
    (lambda: Partial(ExactSum(3), Fraction(1), 1), "disagree"),
])
def test_inconsistent_partials_are_refused(make, match) -> None:
    with pytest.raises(AggregationError, match=match):
        make()


def test_arrays_round_trip_both_kinds(rng) -> None:
    for exact in (False, True):
        p = _leaf([(rng.normal(size=SIZE).astype(np.float32), 3.0, 0.5),
                   (rng.normal(size=SIZE).astype(np.float32), 4.0, 1.0)], exact=exact)
        fields = p.as_arrays()
        assert set(fields) == {"weight", "count", "limbs" if exact else "sum_f32"}
        back = Partial.from_arrays(**fields)
        assert back.exact == exact and back.count == 2 and back.weight == 7
        assert back.mean().tobytes() == p.mean().tobytes()
    with pytest.raises(AggregationError, match="exactly one"):
        Partial.from_arrays(weight=1.0, count=1)
    with pytest.raises(AggregationError, match="index 1"):
        Partial.from_arrays(weight=1.0, count=1, sum_f32=np.array([0, np.nan], np.float32))


def test_the_exact_range_constants_are_consistent() -> None:
    # |sum| < EXACT_LIMIT hi units of 2**-(80 - 60) = 2**42; hi keeps a factor 2 of int64 as
    # margin for the carries that are still pending
    assert EXACT_LIMIT * 2.0 ** -(QUANTUM_BITS - LIMB_BITS) == 2.0**42
    assert 2 * EXACT_LIMIT <= 2**63
