"""Direction filters: FLAME's majority cluster and Divide-and-Conquer, on small arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import AggregationError, create_aggregator
from murmura.aggregation.directions import (
    cosine_matrix,
    dnc_outliers,
    majority_cluster,
    unit_rows,
)

P = 400


def population(seed: int, *, honest: int = 12, bad: int = 4, spread: float = 0.5
               ) -> tuple[np.ndarray, np.ndarray]:
    """Honest rows around one direction; ``bad`` rows around an orthogonal-ish one."""
    rng = np.random.default_rng(seed)
    good_dir, bad_dir = rng.standard_normal((2, P))
    h = good_dir + spread * rng.standard_normal((honest, P))
    b = 0.5 * good_dir + bad_dir + 0.1 * rng.standard_normal((bad, P))
    return h.astype(np.float32), b.astype(np.float32)


def test_majority_cluster_is_the_first_linkage_component_to_hold_a_majority() -> None:
    # Points on a line: a tight run of 4, a looser run of 3 further away, and 2 far outliers.
    pos = np.array([0.0, 0.1, 0.2, 0.3, 1.0, 1.4, 1.8, 9.0, 20.0])
    d = np.abs(pos[:, None] - pos[None, :])
    # Majority 5 of 9: the tight run (4) only reaches it by merging with the looser run at
    # distance 0.7, before the outliers (7.2 and 11 away) join.
    np.testing.assert_array_equal(majority_cluster(d), pos < 5)
    np.testing.assert_array_equal(majority_cluster(d, min_size=4), pos < 0.5)
    np.testing.assert_array_equal(majority_cluster(d, min_size=8), pos < 10)
    assert majority_cluster(d, min_size=1).all()
    with pytest.raises(AggregationError, match="square"):
        majority_cluster(np.zeros((2, 3)))
    with pytest.raises(AggregationError, match="min_size"):
        majority_cluster(d, min_size=10)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_majority_cluster_does_not_depend_on_the_order_of_the_points(seed) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((11, 5))
    d = np.linalg.norm(x[:, None] - x[None], axis=-1)
    perm = rng.permutation(11)
    a = majority_cluster(d)
    b = majority_cluster(d[np.ix_(perm, perm)])
    np.testing.assert_array_equal(a[perm], b)
    assert a.sum() >= 6


def test_cosine_matrix_and_unit_rows() -> None:
    x = np.array([[3.0, 4.0], [0.0, 0.0], [-6.0, -8.0]])
    np.testing.assert_allclose(unit_rows(x), [[0.6, 0.8], [0, 0], [-0.6, -0.8]])
    c = cosine_matrix(x)
    assert c[0, 2] == pytest.approx(-1.0) and c[0, 1] == 0.0


def test_dnc_drops_the_rows_shifted_along_one_direction() -> None:
    h, b = population(1)
    x = np.concatenate([h, b])
    keep = dnc_outliers(x, f=4, c=1.0, iterations=3, subsample=200,
                        rng=np.random.default_rng(0))
    assert not keep[12:].any()  # all four attackers go
    assert keep[:12].sum() == 12  # c x f = 4 dropped, all of them attackers
    assert dnc_outliers(x, f=0, rng=np.random.default_rng(0)).all()


@pytest.mark.parametrize("name", ["flame", "dnc"])
def test_filters_keep_the_aggregate_on_the_honest_side(name) -> None:
    h, b = population(2)
    x = np.concatenate([h, b])
    agg = create_aggregator(name, P, **({"dim": 0} if name == "flame" else {"f": 4}))
    for i, u in enumerate(x):
        agg.add(u, 1.0, client_id=f"c{i}")
    out = agg.result()
    honest = h.mean(axis=0)
    fedavg = x.mean(axis=0)
    assert np.linalg.norm(out - honest) < 0.5 * np.linalg.norm(fedavg - honest)
    kept = agg.last_admitted if name == "flame" else agg.last_kept
    assert not kept[12:].any()


def test_flame_on_sketches_drops_what_exact_cosines_drop_and_clips_to_the_median_norm() -> None:
    h, b = population(3, spread=0.3)
    x = np.concatenate([h, b, 50 * h[:1]])  # one boosted honest-looking update
    results = {}
    for dim in (0, 128):
        agg = create_aggregator("flame", P, dim=dim)
        for i, u in enumerate(x):
            agg.add(u, 1.0, client_id=f"c{i}")
        results[dim] = (agg.result(), agg.last_admitted.copy())
    for _, admitted in results.values():  # which honest rows are tightest may differ
        assert not admitted[12:16].any() and admitted[16]
    norms = np.linalg.norm(x, axis=1)
    assert np.linalg.norm(results[0][0]) <= np.median(norms) * (1 + 1e-5)


def test_flame_noise_is_seeded_and_scaled_by_the_bound() -> None:
    h, _ = population(4)
    outs = []
    for noise in (0.0, 0.1, 0.1):
        agg = create_aggregator("flame", P, dim=0, noise=noise, seed=5)
        for i, u in enumerate(h):
            agg.add(u, 1.0, client_id=f"c{i}")
        outs.append(agg.result())
    np.testing.assert_array_equal(outs[1], outs[2])
    bound = float(np.median(np.linalg.norm(h, axis=1)))
    assert 0.05 * bound < float(np.std(outs[1] - outs[0])) < 0.2 * bound


@pytest.mark.parametrize(("name", "options"), [
    ("flame", {"dim": 8}), ("flame", {"noise": -1.0}), ("dnc", {"fraction": 0.5}),
    ("dnc", {"f": -1}), ("dnc", {"c": 0.0}), ("dnc", {"iterations": 0}),
    ("dnc", {"subsample": 0}),
])
def test_bad_filter_options_are_refused(name, options) -> None:
    with pytest.raises(AggregationError):
        create_aggregator(name, 10, **options)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**16))
def test_dnc_keeps_at_least_one_row_however_much_it_drops(n, f, iterations, seed) -> None:
    # many draws each dropping most rows used to leave the kept set empty: a NaN aggregate
    x = np.random.default_rng(seed).normal(size=(n, 30))
    keep = dnc_outliers(x, f=f, iterations=iterations, subsample=7,
                        rng=np.random.default_rng(seed))
    assert keep.any()
    agg = create_aggregator("dnc", 30, f=f, iterations=iterations, subsample=7, seed=seed)
    for row in x:
        agg.add(row.astype(np.float32), 1.0)
    assert np.isfinite(agg.result()).all()
