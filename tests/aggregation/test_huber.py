"""huber_mean: the mean where nothing is far out, the median where most values agree, bounded
influence of any one row, and the same answer in any row order or column block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import AggregationError
from murmura.aggregation.robust_stats import MAD_SCALE, huber_mean

FAST = settings(max_examples=20, deadline=None)


def reference(x: np.ndarray, c: float, w: np.ndarray | None = None,
              stat: np.ndarray | None = None) -> np.ndarray:
    """The definition, written the slow way: clip to median +- c 1.4826 MAD, weighted mean."""
    s = x if stat is None else stat
    x64, s64 = x.astype(np.float64), s.astype(np.float64)
    med = np.median(s64, axis=0)
    # MAD as huber_mean defines it: the (m // 2 + 1)-th smallest absolute deviation.
    mad = np.sort(np.abs(s64 - med), axis=0)[len(s) // 2]
    r = c * MAD_SCALE * mad
    w = np.ones(len(x)) if w is None else w
    out: np.ndarray = (w / w.sum()) @ np.clip(x64, med - r, med + r)
    return out


def sample(seed: int, n: int, p: int = 30) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(p) + rng.standard_normal((n, p))).astype(np.float32)


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 12), c=st.sampled_from([0.0, 0.5, 1.5, 3.0]))
def test_matches_the_definition(seed, n, c) -> None:
    x = sample(seed, n)
    w = np.random.default_rng(seed).uniform(0.5, 5.0, n)
    np.testing.assert_allclose(huber_mean(x, c=c, weights=w), reference(x, c, w),
                               rtol=1e-5, atol=1e-5)


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(2, 12))
def test_equals_the_weighted_mean_when_nothing_lies_beyond_the_clipping_range(seed, n) -> None:
    x = sample(seed, n)
    w = np.random.default_rng(seed).uniform(0.5, 5.0, n)
    # With c this large every value is inside median +- c sigma (unless the MAD is 0, which
    # continuous samples of n >= 2 never give).
    np.testing.assert_allclose(huber_mean(x, c=1e6, weights=w), (w / w.sum()) @ x,
                               rtol=1e-5, atol=1e-5)


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 12))
def test_c_zero_is_the_coordinate_median(seed, n) -> None:
    x = sample(seed, n)
    np.testing.assert_allclose(huber_mean(x, c=0.0), np.median(x, axis=0), rtol=1e-6, atol=1e-6)


@FAST
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e3, 1e6, 1e12, -1e12]))
def test_one_huge_row_moves_the_result_by_a_bounded_amount(seed, scale) -> None:
    # Prepare: 11 rows; then the same with one row pushed far out, in one direction.
    x = sample(seed, 11)
    attacked = x.copy()
    attacked[4] = scale * np.sign(x[4] + 0.5).astype(np.float32)
    further = attacked.copy()
    further[4] *= 10

    # Execute
    clean, dirty, dirtier = (huber_mean(v, c=1.5) for v in (x, attacked, further))

    # Assert: clipped, the row's magnitude is irrelevant, and the move stays at the scale of
    # the honest values' spread.
    np.testing.assert_array_equal(dirty, dirtier)
    spread = x.max(axis=0) - x.min(axis=0)
    assert np.all(np.abs(dirty - clean) <= spread), np.abs(dirty - clean).max()


@FAST
@given(seed=st.integers(0, 2**16), perm_seed=st.integers(0, 2**16))
def test_does_not_depend_on_row_order(seed, perm_seed) -> None:
    x = sample(seed, 9)
    w = np.random.default_rng(seed).uniform(0.5, 5.0, 9)
    perm = np.random.default_rng(perm_seed).permutation(9)
    np.testing.assert_allclose(huber_mean(x[perm], c=1.5, weights=w[perm]),
                               huber_mean(x, c=1.5, weights=w), rtol=1e-5, atol=1e-6)


def test_a_minority_writing_where_the_majority_agrees_on_zero_is_removed_exactly() -> None:
    # Prepare: 7 rows that never touch the last 5 coordinates (a trigger's dark pixels) and 3
    # distinct rows, with large weights, that write there.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 25)).astype(np.float32)
    x[:7, -5:] = 0.0
    x[7:, -5:] = rng.uniform(0.5, 1.0, (3, 5))
    w = np.array([1.0] * 7 + [4.0] * 3)

    out = huber_mean(x, c=3.0, weights=w)

    np.testing.assert_array_equal(out[-5:], 0.0)
    assert np.all(out[:-5] != 0.0)


def test_statistic_rows_set_the_range_and_every_averaged_row_counts() -> None:
    x = sample(5, 20)
    rows = np.arange(2, 20)
    stat = np.array([3, 5, 8, 13, 17])
    w = np.linspace(1.0, 2.0, 18)
    out = huber_mean(x, c=1.0, weights=w, rows=rows, stat_rows=stat)
    np.testing.assert_allclose(out, reference(x[rows], 1.0, w, x[stat]), rtol=1e-5, atol=1e-6)


def test_column_blocks_and_threads_give_the_unblocked_answer() -> None:
    x = sample(6, 7, p=20_000)  # more than two column blocks
    w = np.arange(1.0, 8.0)
    np.testing.assert_allclose(huber_mean(x, c=1.5, weights=w), reference(x, 1.5, w),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p, tail", [(30, 0), (30, 7), (30, 30), (20_000, 650), (20_000, 12_000)])
def test_the_tail_is_clipped_with_its_own_constant(p, tail) -> None:
    # tail 650 falls inside the last column block, 12,000 spans a block boundary
    x = sample(9, 9, p=p)
    w = np.arange(1.0, 10.0)
    got = huber_mean(x, c=0.8, weights=w, tail=tail, tail_c=2.5)
    np.testing.assert_allclose(got[:p - tail], reference(x, 0.8, w)[:p - tail],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[p - tail:], reference(x, 2.5, w)[p - tail:],
                               rtol=1e-5, atol=1e-5)
    # no tail constant, or the same one: the plain rule
    np.testing.assert_array_equal(huber_mean(x, c=0.8, weights=w, tail=tail),
                                  huber_mean(x, c=0.8, weights=w))


def test_scaling_every_weight_changes_nothing() -> None:
    x = sample(7, 8)
    w = np.arange(1.0, 9.0)
    np.testing.assert_allclose(huber_mean(x, c=1.5, weights=1e6 * w),
                               huber_mean(x, c=1.5, weights=w), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"c": -1.0}, "c must be"),
    ({"c": float("nan")}, "c must be"),
    ({"c": 1.0, "weights": np.ones(3)}, "non-negative weights"),
    ({"c": 1.0, "weights": np.zeros(5)}, "non-negative weights"),
    ({"c": 1.0, "weights": -np.ones(5)}, "non-negative weights"),
    ({"c": 1.0, "rows": np.zeros(0, dtype=np.intp)}, "no updates"),
    ({"c": 1.0, "tail": 31, "tail_c": 2.0}, "tail must hold 0..30"),
    ({"c": 1.0, "tail": 3, "tail_c": -2.0}, "tail_c must be"),
])
def test_bad_arguments_are_refused(kwargs, match) -> None:
    with pytest.raises(AggregationError, match=match):
        huber_mean(sample(8, 5), **kwargs)
