"""Peer-side mixing with Sybil weighting: the weights feed the configured rule instead of
replacing it, and the scorer's collusion screen mutes distinct peers that collude."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.aggregation import SybilWeighting, create_aggregator
from murmura.gossip import mix
from murmura.gossip.mixing import GOSSIP_DEFAULT_OPTIONS

SIZE = 512


def senders(rng: np.random.Generator, honest: int, clones: int = 0
            ) -> list[tuple[str, np.ndarray]]:
    out = [(f"h{i:02d}", rng.standard_normal(SIZE).astype(np.float32)) for i in range(honest)]
    attack = 5 * rng.standard_normal(SIZE).astype(np.float32)
    out += [(f"s{i:02d}", attack + 0.01 * rng.standard_normal(SIZE).astype(np.float32))
            for i in range(clones)]
    return out


def test_with_sybil_weighting_the_configured_rule_still_aggregates() -> None:
    rng = np.random.default_rng(0)
    own = np.zeros(SIZE, np.float32)
    received = senders(rng, 5)
    out = mix(own, received, rule="median", sybil=SybilWeighting(SIZE, dim=64))
    median = create_aggregator("median", SIZE)
    median.add(np.zeros(SIZE, np.float32), 1.0, client_id="self")
    for sender, m in received:
        median.add(m, 1.0, client_id=sender)
    np.testing.assert_allclose(out, median.result(), atol=1e-6)
    # fedavg with the weighting is the weighted mean of the own model (weight 1) and the rest
    plain = mix(own, received, sybil=SybilWeighting(SIZE, dim=64))
    np.testing.assert_allclose(plain, np.mean([own, *(m for _, m in received)], axis=0),
                               atol=1e-5)


def test_clones_are_left_out_before_the_rule_votes() -> None:
    # Six clones against three honest neighbours own a median; weighted out, they do not.
    rng = np.random.default_rng(1)
    own = np.zeros(SIZE, np.float32)
    received = senders(rng, 3, clones=6)
    attack = received[-1][1]
    guarded = mix(own, received, rule="median", sybil=SybilWeighting(SIZE, dim=256))
    expected = np.median(np.stack([own, *(m for _, m in received[:3])]), axis=0)
    np.testing.assert_allclose(guarded, expected, atol=1e-6)
    captured = mix(own, received, rule="median")
    assert np.linalg.norm(captured - attack) < np.linalg.norm(guarded - attack)


def test_distinct_colluding_neighbours_lose_their_weight_over_rounds() -> None:
    # 20 honest neighbours with their own persistent directions; 5 distinct colluders that add
    # one shared objective. None is a clone, so only the screen can tell them apart.
    rng = np.random.default_rng(2)
    own_dirs = rng.standard_normal((25, SIZE)).astype(np.float32)
    goal = 2.0 * rng.standard_normal(SIZE).astype(np.float32)
    scorer = SybilWeighting(SIZE, dim=128)
    names = [f"h{i:02d}" for i in range(20)] + [f"a{i}" for i in range(5)]
    own = np.zeros(SIZE, np.float32)
    for _ in range(5):
        models = 1.0 + own_dirs + 0.5 * rng.standard_normal((25, SIZE)).astype(np.float32)
        models[20:] += goal
        mix(own, list(zip(names, models, strict=True)), rule="default", sybil=scorer)
    trust = scorer.weights(names) * scorer.screen.weights(names)
    np.testing.assert_array_equal(trust[20:], 0.0)
    # A peer's screen cuts at lower z-scores than a server's (aggregation/sybil_scores.py:
    # honest peers converge, so their residuals are tighter than these independent ones);
    # the price is an honest outlier now and then: one of these 20.
    assert np.sum(trust[:20] >= 0.9) >= 19


def test_trust_scale_shrinks_every_neighbours_weight_but_not_the_own_one() -> None:
    own = np.zeros(SIZE, np.float32)
    other = np.full(SIZE, 3.0, np.float32)
    full = mix(own, [("a", other)], sybil=SybilWeighting(SIZE, dim=64))
    half = mix(own, [("a", other)], sybil=SybilWeighting(SIZE, dim=64), trust_scale=0.5)
    np.testing.assert_allclose(full, 1.5)          # (own + other) / 2
    np.testing.assert_allclose(half, 1.0)          # (1 * own + 0.5 * other) / 1.5
    for bad in (0.0, -1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="trust_scale"):
            mix(own, [("a", other)], sybil=SybilWeighting(SIZE, dim=64), trust_scale=bad)


def test_a_peers_default_rule_screens_one_batch_of_neighbours() -> None:
    # The mixing's own rule sees one batch (own model plus the received ones); with the
    # gossip options its screen judges from 6 rows, so clones hidden under noise as large as
    # half their update lose their vote in the very first mixing, before any history exists.
    rng = np.random.default_rng(4)
    own = np.zeros(SIZE, np.float32)
    honest = [(f"h{i}", rng.standard_normal(SIZE).astype(np.float32)) for i in range(4)]
    lead = 3.0 * rng.standard_normal(SIZE).astype(np.float32)
    jitter = 0.5 * float(np.linalg.norm(lead)) / np.sqrt(SIZE)
    clones = [(f"s{i}", lead + jitter * rng.standard_normal(SIZE).astype(np.float32))
              for i in range(3)]
    agg = create_aggregator("default", SIZE, **GOSSIP_DEFAULT_OPTIONS)
    assert agg.screen is not None and agg.screen.min_clients == 6
    pull = lead / np.linalg.norm(lead)  # how far a mixing moves towards the clones' lead
    out = mix(own, honest + clones, rule="default")
    np.testing.assert_allclose(out, mix(own, honest, rule="default"), atol=1e-6)
    server_like = mix(own, honest + clones, rule="default",
                      options={"screen_min_clients": 16})  # a server's screen: no judgement
    assert float(server_like @ pull) > 10.0 and abs(float(out @ pull)) < 0.1
