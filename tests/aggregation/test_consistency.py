"""`default`'s consistency weight (stage 1b): an update that turns away from its own client's
history loses its vote from that update on; consistent clients, newcomers and anonymous rows
keep theirs."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.aggregation import SybilWeighting, create_aggregator
from murmura.aggregation.base import AggregationError

P = 300


def client_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Each client's own lasting direction (its data)."""
    return rng.standard_normal((n, P)) / np.sqrt(P)


def rounds_of(rng: np.random.Generator, own: np.ndarray) -> np.ndarray:
    common = np.full(P, 0.5 / np.sqrt(P))
    noise = 0.3 * rng.standard_normal(own.shape) / np.sqrt(P)
    return (own + common + noise).astype(np.float32)


def run(agg, x: np.ndarray, ids: list[str]) -> np.ndarray:
    for u, cid in zip(x, ids, strict=True):
        agg.add(u, 10.0, client_id=cid)
    agg.result()
    effective = agg.last_effective.copy()
    agg.reset()
    return effective


def rule(**options: object):
    # the other screens off: this stage alone
    return create_aggregator("default", P, screen=False, direction_trim=0.0, **options)


def test_a_client_that_turns_its_updates_around_loses_its_vote_at_once() -> None:
    rng = np.random.default_rng(0)
    own = client_rows(rng, 12)
    ids = [f"c{i}" for i in range(12)]
    agg = rule()
    for _ in range(4):  # trust built: every client consistent
        effective = run(agg, rounds_of(rng, own), ids)
        assert (effective > 0).all()
    x = rounds_of(rng, own)
    x[:2] *= -3.0  # two clients switch: their updates point against their own history
    effective = run(agg, x, ids)
    np.testing.assert_array_equal(effective[:2], 0.0)
    assert (effective[2:] > 0).all()
    assert agg.last_consistency[:2].max() < 0 < agg.last_consistency[2:].min()


def test_newcomers_anonymous_rows_and_the_option_off_keep_every_vote() -> None:
    rng = np.random.default_rng(1)
    own = client_rows(rng, 8)
    agg = rule()
    first = run(agg, rounds_of(rng, own), [f"c{i}" for i in range(8)])
    assert (first > 0).all() and np.isnan(agg.last_consistency).all()  # no history yet
    x = -rounds_of(rng, own)
    anonymous = run(agg, x, [""] * 8)  # no identity, no history to be judged against
    assert (anonymous > 0).all()
    off = rule(consistency_low=None, consistency_high=None)
    run(off, rounds_of(rng, own), [f"c{i}" for i in range(8)])
    assert (run(off, -rounds_of(rng, own), [f"c{i}" for i in range(8)]) > 0).all()


def test_the_ramp_reads_the_gap_below_the_buffers_median_agreement() -> None:
    agg = rule()  # gaps 0.5 to 0.75
    agg.last_consistency = np.array([0.9, 0.9, 0.9, 0.9, 0.3, 0.275, 0.15, np.nan])
    ids = [f"c{i}" for i in range(8)]
    np.testing.assert_allclose(agg.consistency_weights(ids),
                               [1.0, 1.0, 1.0, 1.0, 0.6, 0.5, 0.0, 1.0])
    ids[6] = ""  # anonymous: not judged, and not part of the median
    np.testing.assert_allclose(agg.consistency_weights(ids)[6], 1.0)
    agg.last_consistency = np.array([0.9, -0.5, np.nan, np.nan])  # fewer than 3 judged
    np.testing.assert_array_equal(agg.consistency_weights(ids[:4]), 1.0)


def test_where_every_update_is_noise_nobody_is_judged() -> None:
    # Near convergence updates are mostly noise: every agreement is near 0, so none is an
    # outlier, and no honest vote is lost for it.
    rng = np.random.default_rng(3)
    ids = [f"c{i}" for i in range(10)]
    agg = rule()
    for _ in range(5):
        effective = run(agg, (rng.standard_normal((10, P)) / np.sqrt(P)).astype(np.float32),
                        ids)
    assert np.abs(agg.last_consistency).max() < 0.5
    assert (effective > 0).all()


def test_the_scorer_measures_the_cosine_with_the_history_before_the_update() -> None:
    scorer = SybilWeighting(P, dim=64)
    rng = np.random.default_rng(2)
    u = rng.standard_normal(P).astype(np.float32)
    sketch = scorer.sketch(u)
    assert np.isnan(scorer.consistency(["a"], sketch[None])).all()
    scorer.observe("a", sketch)
    np.testing.assert_allclose(scorer.consistency(["a", "b"], np.stack([sketch, -sketch])),
                               [1.0, np.nan])
    np.testing.assert_allclose(scorer.consistency(["a"], -sketch[None]), [-1.0])


@pytest.mark.parametrize("low, high", [(0.3, 0.2), (0.2, 0.2), (-0.1, 0.2), (0.5, 2.5),
                                       (0.0, None), (None, 0.25)])
def test_bad_consistency_ends_are_refused(low: object, high: object) -> None:
    with pytest.raises(AggregationError, match="consistency_low"):
        rule(consistency_low=low, consistency_high=high)
