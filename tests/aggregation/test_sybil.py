"""Sybil weighting: clones lose their weight, honest non-IID clients keep it; bounded state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import AggregationError, FedBuff, create_aggregator
from murmura.aggregation.robust_stats import huber_mean
from murmura.aggregation.staleness import Polynomial
from murmura.aggregation.sybil import SybilMean, SybilWeighting, sketch_rows

P = 3000


class Population:
    """Synthetic rounds: honest = shared descent + a persistent client direction + noise."""

    def __init__(self, seed: int, *, honest: int = 10, clones: int = 5,
                 jitter: float = 0.05) -> None:
        self.rng = np.random.default_rng(seed)
        self.honest, self.clones, self.jitter = honest, clones, jitter
        self.own = self.rng.standard_normal((honest, P)) * 0.8 / np.sqrt(P)
        self.poison = self.rng.standard_normal(P) / np.sqrt(P)

    def round(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        common = np.full(P, 1.0 / np.sqrt(P)) * (1.0 / (1 + 0.1 * t))
        noise = self.rng.standard_normal((self.honest, P)) * 0.3 / np.sqrt(P)
        honest = (common + self.own + noise).astype(np.float32)
        poisoned = 0.3 * common + self.poison
        jit = self.rng.standard_normal((self.clones, P)) * self.jitter / np.sqrt(P)
        clones = (poisoned + jit * np.linalg.norm(poisoned)).astype(np.float32)
        return honest, clones

    def arrivals(self, t: int) -> list[tuple[str, np.ndarray, int]]:
        """(client id, update, staleness) in a random order; some arrive stale."""
        honest, clones = self.round(t)
        items = [(f"h{i}", u, int(self.rng.integers(0, 3))) for i, u in enumerate(honest)]
        items += [(f"s{i}", u, int(self.rng.integers(0, 3))) for i, u in enumerate(clones)]
        return [items[i] for i in self.rng.permutation(len(items))]


def weights_by_id(agg: SybilMean, ids: list[str]) -> dict[str, float]:
    return {c: float(w) for c, w in zip(ids, agg.scorer.weights(ids), strict=True)}


# ----------------------------------------------------------------------------- the scenario


def test_clones_lose_their_weight_and_honest_clients_keep_it_under_async_staleness() -> None:
    # Prepare: FedBuff with buffers of 5, so clones mostly land in different buffers.
    pop = Population(0)
    buf = FedBuff(P, buffer_size=5, max_staleness=4, staleness=Polynomial(0.5),
                  aggregator=lambda size: SybilMean(size))
    agg = buf._agg
    assert isinstance(agg, SybilMean)

    # Execute: 6 rounds of arrivals, flushing whenever the buffer is full.
    for t in range(6):
        for cid, update, tau in pop.arrivals(t):
            if buf.add(update, 50.0, tau, client_id=cid):
                buf.flush()

    # Assert
    w = weights_by_id(agg, [f"h{i}" for i in range(10)] + [f"s{i}" for i in range(5)])
    assert max(w[f"s{i}"] for i in range(5)) <= 0.05
    assert min(w[f"h{i}"] for i in range(10)) >= 0.9


def test_default_keeps_the_aggregate_on_the_honest_side_of_a_clone_majority() -> None:
    # Prepare: 10 honest identities against 12 clones (55% of identities).
    pop = Population(1, clones=12)
    default, fedavg = create_aggregator("default", P), create_aggregator("fedavg", P)

    # Execute
    for t in range(4):
        honest, clones = pop.round(t)
        for agg in (default, fedavg):
            agg.reset()
            for i, u in enumerate(honest):
                agg.add(u, 50.0, client_id=f"h{i}")
            for i, u in enumerate(clones):
                agg.add(u, 50.0, client_id=f"s{i}")
        out, plain = default.result(), fedavg.result()

    # Assert: the default sits near the honest mean; FedAvg is pulled to the poison.
    target = honest.mean(axis=0)

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    assert cos(out, target) > 0.95
    assert cos(plain, target) < 0.8
    assert abs(cos(out, pop.poison)) < 0.15


def test_honest_non_iid_clients_keep_full_weight_and_keep_the_default_near_fedavg() -> None:
    pop = Population(2, clones=0)
    default, cclip, fedavg = (create_aggregator(n, P) for n in ("default", "sybil-cclip",
                                                                 "fedavg"))
    for t in range(5):
        honest, _ = pop.round(t)
        for agg in (default, cclip, fedavg):
            agg.reset()
            for i, u in enumerate(honest):
                agg.add(u, 10.0 + i, client_id=f"h{i}")
        out, clipped, plain = default.result(), cclip.result(), fedavg.result()
        # every one keeps its Sybil weight; the direction stage leaves out at most a quarter
        assert np.all(default.last_weights >= 0.99) and len(default.last_voters) >= 8
        assert np.linalg.norm(clipped - plain) <= 0.05 * np.linalg.norm(plain)
        # The median gives up some averaging, but stays on the honest mean's side.
        cos = float(out @ plain / np.linalg.norm(out) / np.linalg.norm(plain))
        assert cos > 0.9, cos


def test_a_first_round_of_clones_is_already_caught() -> None:
    honest, clones = Population(3).round(0)
    agg = SybilMean(P)
    for i, u in enumerate(honest):
        agg.add(u, 1.0, client_id=f"h{i}")
    for i, u in enumerate(clones):
        agg.add(u, 1.0, client_id=f"s{i}")
    agg.result()
    assert np.all(agg.last_weights[10:] <= 0.05)
    assert np.all(agg.last_weights[:10] >= 0.9)


def test_two_updates_of_one_client_in_a_buffer_are_not_clones_of_each_other() -> None:
    honest, _ = Population(4).round(0)
    agg = SybilMean(P)
    for i, u in enumerate(honest):
        agg.add(u, 1.0, client_id=f"h{i}")
    agg.add(honest[0] * 1.01, 1.0, client_id="h0")  # a fast client's second update
    agg.result()
    assert np.all(agg.last_weights >= 0.9)


def test_updates_without_client_id_get_one_off_histories() -> None:
    honest, clones = Population(5).round(0)
    agg = SybilMean(P)
    for u in list(honest) + list(clones):
        agg.add(u, 1.0)
    agg.result()
    assert np.all(agg.last_weights[10:] <= 0.05)  # clones in one buffer are still seen
    np.testing.assert_array_equal(agg.result(), agg.result())
    agg.reset()
    assert len(agg.scorer) == 0  # nothing persisted for anonymous updates


def test_when_every_update_is_a_clone_the_aggregate_is_zero() -> None:
    _, clones = Population(6).round(0)
    agg = SybilMean(P)
    for i, u in enumerate(clones):
        agg.add(u, 1.0, client_id=f"s{i}")
    np.testing.assert_array_equal(agg.result(), np.zeros(P, np.float32))


@pytest.mark.parametrize("name", ["sybil", "default"])
@settings(max_examples=8, deadline=None)
@given(perm_seed=st.integers(0, 2**16))
def test_sybil_rules_do_not_depend_on_arrival_order(name, perm_seed) -> None:
    honest, clones = Population(7).round(0)
    x = np.concatenate([honest, clones])
    ids = [f"c{i}" for i in range(len(x))]
    perm = np.random.default_rng(perm_seed).permutation(len(x))
    results = []
    for order in (np.arange(len(x)), perm):
        agg = create_aggregator(name, P)
        for i in order:
            agg.add(x[i], 1.0 + i, client_id=ids[i])
        results.append(agg.result())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1e3, 1e9])
def test_one_huge_update_moves_the_default_by_a_bounded_amount(scale) -> None:
    honest, _ = Population(8).round(0)
    attacked = honest.copy()
    attacked[0] = scale * np.random.default_rng(0).standard_normal(P).astype(np.float32)
    out = []
    for x in (honest, attacked):
        agg = create_aggregator("default", P)
        for i, u in enumerate(x):
            agg.add(u, 1.0, client_id=f"c{i}")
        out.append(agg.result())
    assert np.linalg.norm(out[1] - out[0]) <= 0.5 * np.linalg.norm(honest, axis=1).max()


# ----------------------------------------------------------------------------- the sketch


def test_sketch_is_linear_seeded_and_preserves_cosines() -> None:
    rng = np.random.default_rng(9)
    p = 50_001  # not a multiple of the sketch size or of the block
    a = rng.standard_normal(p).astype(np.float32)
    b = (0.6 * a + 0.8 * rng.standard_normal(p)).astype(np.float32)
    sa, sb = sketch_rows(a, dim=512, seed=1), sketch_rows(b, dim=512, seed=1)

    np.testing.assert_allclose(sketch_rows(np.stack([a, b]), dim=512, seed=1), [sa, sb])
    np.testing.assert_allclose(sketch_rows(a + b, dim=512, seed=1), sa + sb, rtol=1e-5,
                               atol=1e-3)
    assert not np.allclose(sketch_rows(a, dim=512, seed=2), sa)
    true_cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    est_cos = sa @ sb / np.linalg.norm(sa) / np.linalg.norm(sb)
    assert abs(est_cos - true_cos) < 0.1


# ----------------------------------------------------------------------------- bounded state


def test_state_size_does_not_grow_with_the_model() -> None:
    sizes = []
    for model_size in (1_000, 200_000):
        scorer = SybilWeighting(model_size, dim=64, max_clients=100)
        update = np.ones(model_size, np.float32)
        for i in range(150):
            scorer.observe(f"c{i}", scorer.sketch(update) * (i + 1))
        sizes.append(scorer.state_nbytes)
    assert sizes[0] == sizes[1] <= 100 * (2 * 64 * 4 + 8)  # histories, last updates, clock


def test_client_cap_evicts_the_least_recently_observed() -> None:
    scorer = SybilWeighting(10, dim=16, max_clients=3)
    sketch = np.ones(16)
    for cid in ("a", "b", "c"):
        scorer.observe(cid, sketch)
    scorer.observe("a", sketch)  # a is now the most recent; b the least
    scorer.observe("d", sketch)
    assert len(scorer) == 3 and "b" not in scorer and {"a", "c", "d"} <= set(
        c for c in "abcd" if c in scorer)
    with pytest.raises(AggregationError, match="no history"):
        scorer.weights(["b"])


def test_a_buffer_with_more_clients_than_the_cap_is_refused() -> None:
    agg = SybilMean(10, dim=16, max_clients=3)
    for i in range(4):
        agg.add(np.full(10, float(i), np.float32), 1.0, client_id=f"c{i}")
    with pytest.raises(AggregationError, match="max_clients"):
        agg.result()


@pytest.mark.parametrize("options", [
    {"dim": 8}, {"max_clients": 1}, {"low": 0.9, "high": 0.9}, {"low": -2.0},
    {"weight_cap": 0.0},
])
def test_bad_sybil_options_are_refused(options) -> None:
    with pytest.raises(AggregationError):
        create_aggregator("sybil", 10, **options)


@pytest.mark.parametrize(("name", "options"), [
    ("sybil-cclip", {"clip_multiplier": 0.0}), ("sybil-cclip", {"tau_scale": -1.0}),
    ("sybil-cclip", {"iterations": 0}), ("default", {"max_rows": 0}),
    ("default", {"huber_c": -1.0}), ("default", {"weight_cap": 0.5}),
    ("default", {"recent": -1}), ("sybil", {"recent": 1.5}), ("default", {"norm_cap": 0.5}),
    ("default", {"history": -1}), ("default", {"history": 2.5}),
    ("default", {"head": 11}), ("default", {"head": -1}), ("default", {"head": 1.5}),
    ("default", {"head": 3, "head_c": float("inf")}), ("default", {"head_c": -0.5}),
])
def test_bad_default_options_are_refused(name, options) -> None:
    with pytest.raises(AggregationError):
        create_aggregator(name, 10, **options)


# ----------------------------------------------------------------------------- switching Sybils


def _switching_population(seed: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    own = rng.standard_normal((15, P)) / np.sqrt(P)  # 10 honest + 5 Sybils, distinct data
    poison = rng.standard_normal(P) / np.sqrt(P)
    return own, poison, rng


def _round(own: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    common = np.full(P, 1.0 / np.sqrt(P))
    return (common + own + 0.3 * rng.standard_normal(own.shape) / np.sqrt(P)).astype(np.float32)


@pytest.mark.parametrize("name", ["sybil", "default"])
def test_sybils_that_build_trust_lose_their_weight_as_soon_as_they_switch(name) -> None:
    # Prepare: 5 Sybils behave like distinct honest clients for 8 rounds, so their histories
    # are as diverse as the honest ones.
    own, poison, rng = _switching_population(10)
    agg = create_aggregator(name, P)
    ids = [f"h{i}" for i in range(10)] + [f"s{i}" for i in range(5)]
    for _ in range(8):
        agg.reset()
        for cid, u in zip(ids, _round(own, rng), strict=True):
            agg.add(u, 1.0, client_id=cid)
        agg.result()
    assert np.all(agg.last_weights >= 0.99)

    # Execute: they switch to one shared vector (5 % jitter each).
    agg.reset()
    honest = _round(own, rng)[:10]
    clones = poison + 0.05 * rng.standard_normal((5, P)) / np.sqrt(P)
    for cid, u in zip(ids, np.concatenate([honest, clones.astype(np.float32)]), strict=True):
        agg.add(u, 1.0, client_id=cid)
    agg.result()

    # Assert: caught in the first version after the switch, while the histories alone still
    # say "distinct" (the history cosine of the Sybils is below the low threshold).
    assert np.all(agg.last_weights[10:] <= 0.05)
    assert np.all(agg.last_weights[:10] >= 0.9)
    hist = agg.scorer._hist[[agg.scorer._slots[c] for c in ids[10:]]].astype(np.float64)
    unit = hist / np.linalg.norm(hist, axis=1, keepdims=True)
    sims = unit @ unit.T - 2 * np.eye(5)
    assert sims.max() < agg.scorer.low


def test_switching_sybils_split_across_async_buffers_are_caught_by_the_second() -> None:
    own, poison, rng = _switching_population(11)
    agg = SybilMean(P, recent=3)
    ids = [f"h{i}" for i in range(10)] + [f"s{i}" for i in range(5)]
    for _ in range(6):
        agg.reset()
        for cid, u in zip(ids, _round(own, rng), strict=True):
            agg.add(u, 1.0, client_id=cid)
        agg.result()
    shared = poison.astype(np.float32)
    lost = []
    for version, sybil in enumerate(ids[10:]):  # one Sybil per buffer, with 5 honest updates
        agg.reset()
        honest = _round(own, rng)[version * 2: version * 2 + 5]
        for cid, u in zip(ids[version * 2: version * 2 + 5], honest, strict=True):
            agg.add(u, 1.0, client_id=cid)
        jitter = 0.05 * rng.standard_normal(P).astype(np.float32) / np.sqrt(P)
        agg.add(shared + jitter, 1.0, client_id=sybil)
        agg.result()
        lost.append(float(agg.last_weights[-1]))
    assert lost[0] == 1.0  # alone, the first switcher looks like anyone else
    assert max(lost[1:]) <= 0.05  # every later one matches the first one's last update


def test_last_updates_older_than_recent_buffers_are_not_compared() -> None:
    scorer = SybilWeighting(P, recent=1)
    rng = np.random.default_rng(12)
    same = rng.standard_normal(P).astype(np.float32)
    for cid in ("a", "b", "c"):
        scorer.tick()
        scorer.observe(cid, scorer.sketch(rng.standard_normal(P).astype(np.float32)))
    scorer.tick()
    scorer.observe("a", scorer.sketch(same))
    scorer.tick()
    scorer.tick()  # two buffers later: a's last update is stale
    scorer.observe("b", scorer.sketch(same + 0.01 * rng.standard_normal(P).astype(np.float32)))
    assert scorer.max_similarity(["b"])[0] < 0.5
    scorer.observe("c", scorer.sketch(same))
    assert scorer.max_similarity(["b", "c"]).min() > 0.99


# ----------------------------------------------------------------------------- the default


def test_default_keeps_a_minority_backdoor_out_of_coordinates_honest_clients_leave_alone() -> None:
    # Prepare: 10 honest updates that never touch the last 20 coordinates (a trigger's pixels
    # are dark in honest data) and 3 distinct attackers of ordinary norm that write there.
    rng = np.random.default_rng(13)
    honest = (np.full(P, 1.0 / np.sqrt(P)) + rng.standard_normal((10, P)) / np.sqrt(P))
    honest[:, -20:] = 0.0
    attackers = honest[:3] + rng.standard_normal((3, P)) * 0.1 / np.sqrt(P)
    attackers[:, -20:] = 0.2
    x = np.concatenate([honest, attackers]).astype(np.float32)
    out = {}
    for name in ("default", "sybil-cclip", "fedavg"):
        agg = create_aggregator(name, P)
        for i, u in enumerate(x):
            agg.add(u, 1.0, client_id=f"c{i}")
        out[name] = agg.result()
    np.testing.assert_array_equal(out["default"][-20:], 0.0)
    assert np.all(out["sybil-cclip"][-20:] > 0.02)  # averaging rules let it through
    assert np.all(out["fedavg"][-20:] > 0.02)


def test_default_takes_its_clipping_range_from_a_reproducible_subset_and_averages_all() -> None:
    x = np.random.default_rng(14).standard_normal((20, 50)).astype(np.float32)
    results, stats = [], []
    for _ in range(2):
        agg = create_aggregator("default", 50, max_rows=7, seed=3, direction_trim=0.0)
        for i, u in enumerate(x):
            agg.add(u, 1.0, client_id=f"c{i}")
        results.append(agg.result())
        stats.append(agg.last_stat_rows.copy())
        np.testing.assert_array_equal(agg.result(), results[-1])  # result() is repeatable
    assert len(stats[0]) == 7 and len(agg.last_voters) == 20
    np.testing.assert_array_equal(stats[0], stats[1])
    expected = huber_mean(x, c=agg.huber_c, stat_rows=stats[0])
    np.testing.assert_allclose(results[0], expected, rtol=1e-6)
    # the range comes from the subset: with every row as statistic the result differs
    assert not np.allclose(results[0], huber_mean(x, c=agg.huber_c))


def _feed(agg, rows, ids: list[str]) -> np.ndarray:
    for u, cid in zip(rows, ids, strict=True):
        agg.add(u, 1.0, client_id=cid)
    out = agg.result()
    np.testing.assert_array_equal(agg.result(), out)  # repeatable until reset()
    agg.reset()
    return out


def test_a_small_buffer_that_attackers_fill_is_screened_with_earlier_voters() -> None:
    # Prepare: 10 honest clients that never touch the last 20 coordinates and 3 distinct
    # attackers that write there. Two buffers of 5 honest clients each, then a buffer of
    # 5 in which the 3 attackers are the majority (async buffers are small samples).
    rng = np.random.default_rng(21)
    honest = (np.full(P, 1.0 / np.sqrt(P)) + rng.standard_normal((10, P)) / np.sqrt(P))
    honest[:, -20:] = 0.0
    attackers = honest[:3] + rng.standard_normal((3, P)) * 0.1 / np.sqrt(P)
    attackers[:, -20:] = 0.2
    h_ids, a_ids = [f"h{i}" for i in range(10)], [f"a{i}" for i in range(3)]
    last = np.concatenate([attackers, honest[:2]]).astype(np.float32)
    out = {}
    for history in (0, 32):
        # the collusion screen would catch these attackers too: off, to test history alone
        agg = create_aggregator("default", P, history=history, screen=False, direction_trim=0.0)
        _feed(agg, honest[:5].astype(np.float32), h_ids[:5])
        _feed(agg, honest[5:].astype(np.float32), h_ids[5:])
        out[history] = _feed(agg, last, a_ids + h_ids[:2])
        if history:  # the 8 honest clients not in the buffer, newest first, once each
            assert agg.last_history == h_ids[9:1:-1]
    # Assert: alone, the buffer's median is the attackers'; with history it is honest.
    assert np.all(out[0][-20:] > 0.1)
    np.testing.assert_array_equal(out[32][-20:], 0.0)


def test_history_keeps_one_row_per_client_newest_and_at_most_history_clients() -> None:
    rng = np.random.default_rng(22)
    agg = create_aggregator("default", 30, history=3)
    rows = {}
    for t, ids in enumerate([["a", "b"], ["a", "c"], ["a", "d"], ["e", "a"]]):
        x = rng.standard_normal((2, 30)).astype(np.float32)
        rows.update({(cid, t): u for cid, u in zip(ids, x, strict=True)})
        _feed(agg, x, ids)
    # 'a' pushed four times but holds one row, its newest; 'b' and 'c' were evicted.
    assert list(agg._past_slots) == ["d", "e", "a"]
    for cid, t in (("d", 2), ("e", 3), ("a", 3)):
        np.testing.assert_array_equal(agg._past[agg._past_slots[cid]], rows[cid, t])
    _feed(agg, rng.standard_normal((2, 30)).astype(np.float32), ["a", "z"])
    assert agg.last_history == ["e", "d"]


def test_a_rebuilt_default_rule_matches_the_original_once_its_history_has_refilled() -> None:
    # history rows are left out of the state: the first small buffer after a rebuild is
    # screened without them, and once every history row was replaced the two agree again.
    rng = np.random.default_rng(23)
    x = [rng.standard_normal((4, 60)).astype(np.float32) for _ in range(4)]
    first, second = [f"c{i}" for i in range(4)], [f"c{i}" for i in range(4, 8)]
    original = create_aggregator("default", 60, history=4, dim=16)
    _feed(original, x[0], first)
    _feed(original, x[1], second)
    rebuilt = create_aggregator("default", 60, history=4, dim=16)
    rebuilt.load_state_dict(original.state_dict())
    assert not np.array_equal(_feed(rebuilt, x[2], first), _feed(original, x[2], first))
    np.testing.assert_array_equal(_feed(rebuilt, x[3], second), _feed(original, x[3], second))


def test_default_gives_no_vote_to_updates_far_longer_than_the_median() -> None:
    # Two boosted sign flippers (-20x) next to six honest updates: every coordinate's order
    # has them at one end, which would shift a plain median toward them.
    rng = np.random.default_rng(15)
    honest = (np.full(P, 1.0 / np.sqrt(P)) + rng.standard_normal((6, P)) / np.sqrt(P))
    x = np.concatenate([honest, -20 * honest[:2]]).astype(np.float32)
    agg = create_aggregator("default", P, direction_trim=0.0)
    for i, u in enumerate(x):
        agg.add(u, 1.0, client_id=f"c{i}")
    out = agg.result()
    np.testing.assert_array_equal(agg.last_voters, np.arange(6))
    np.testing.assert_allclose(out, huber_mean(honest.astype(np.float32), c=agg.huber_c),
                               rtol=1e-6)
    plain = create_aggregator("default", P, norm_cap=None, direction_trim=0.0)
    for i, u in enumerate(x):
        plain.add(u, 1.0, client_id=f"c{i}")
    assert len(plain.result()) == P and len(plain.last_voters) == 8


def test_default_is_close_to_the_mean_on_honest_spread_and_huber_c_zero_is_the_median() -> None:
    # Prepare: 15 honest Gaussian updates with unequal example counts.
    rng = np.random.default_rng(16)
    x = (np.full(P, 1.0 / np.sqrt(P)) + rng.standard_normal((15, P)) / np.sqrt(P))
    x = x.astype(np.float32)
    w = rng.uniform(10.0, 30.0, 15)

    def run(**options: float) -> np.ndarray:
        agg = create_aggregator("default", P, **options, direction_trim=0.0)
        for i, (u, wi) in enumerate(zip(x, w, strict=True)):
            agg.add(u, float(wi), client_id=f"c{i}")
        return agg.result()

    out, median = run(), run(huber_c=0.0)
    mean = (w / w.sum()) @ x

    # Assert: the Huber mean is far closer to FedAvg's mean than the median is, and
    # huber_c=0 is exactly the previous rule (the coordinate median).
    assert np.linalg.norm(out - mean) < 0.5 * np.linalg.norm(median - mean)
    np.testing.assert_allclose(median, np.median(x, axis=0), rtol=1e-6, atol=1e-7)


def test_default_clips_its_head_with_head_c_and_the_rest_with_huber_c() -> None:
    # The same honest buffer through three rules: the head's values come from the rule whose
    # huber_c is head_c, the body's from the rule with the body's constant.
    rng = np.random.default_rng(17)
    x = (np.full(P, 1.0 / np.sqrt(P)) + rng.standard_normal((15, P)) / np.sqrt(P))
    x = x.astype(np.float32)
    head = P // 4

    def run(**options: float) -> np.ndarray:
        agg = create_aggregator("default", P, **options)
        for i, u in enumerate(x):
            agg.add(u, 20.0, client_id=f"c{i}")
        return agg.result()

    split, body, loose = run(huber_c=0.5, head=head, head_c=3.0), run(huber_c=0.5), \
        run(huber_c=3.0)
    np.testing.assert_allclose(split[:-head], body[:-head], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(split[-head:], loose[-head:], rtol=1e-6, atol=1e-7)
    assert not np.allclose(body[-head:], loose[-head:])  # the constants do differ there
    np.testing.assert_array_equal(run(huber_c=0.5, head=head), body)  # no head_c: one constant


def test_default_caps_a_claimed_example_count() -> None:
    # An attacker of ordinary norm claiming 1e9 examples weighs like weight_cap median clients.
    rng = np.random.default_rng(17)
    x = (np.full(P, 1.0 / np.sqrt(P)) + rng.standard_normal((10, P)) / np.sqrt(P))
    x[0] = -x[0]
    x = x.astype(np.float32)

    def run(claim: float, **options: float | None) -> np.ndarray:
        agg = create_aggregator("default", P, **options, direction_trim=0.0)
        for i, u in enumerate(x):
            agg.add(u, claim if i == 0 else 10.0, client_id=f"c{i}")
        return agg.result()

    capped, uncapped = run(1e9), run(1e9, weight_cap=None)
    agg_c = create_aggregator("default", P, direction_trim=0.0).huber_c
    expected = huber_mean(x, c=agg_c, weights=np.array([40.0] + [10.0] * 9))
    np.testing.assert_allclose(capped, expected, rtol=1e-5, atol=1e-7)
    # uncapped, the attacker owns the result within its clipping range
    assert np.linalg.norm(uncapped - x[0]) < np.linalg.norm(capped - x[0])
