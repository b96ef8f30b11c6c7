"""state_dict / load_state_dict of the rules that carry state from one aggregate to the next:
a rule rebuilt from its state aggregates the next buffer exactly as the original does."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.aggregation import AggregationError, create_aggregator

SIZE = 40


def buffers(seed: int, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=SIZE).astype(np.float32)
    # buffers of growing scale, so a rule's memory of earlier buffers shows in its result
    return [(1 + 2 * k) * np.vstack([base + 0.3 * rng.normal(size=SIZE).astype(np.float32)
                                     for _ in range(5)]) for k in range(n)]


def feed(agg, rows: np.ndarray) -> np.ndarray:
    for i, row in enumerate(rows):
        agg.add(row, float(10 + i), factor=1.0, client_id=f"c{i % 4}")
    out = agg.result()
    agg.reset()
    return out


@pytest.mark.parametrize("name, options", [
    ("clip", {"window": 3, "multiplier": 1.0}),
    ("centered-clip", {"tau_scale": 0.3}),
    ("sybil", {"dim": 16}),
    ("default", {"dim": 16}),
    ("flame", {"noise": 0.05, "dim": 0}),   # its noise generator
    ("dnc", {"subsample": 8, "f": 2}),      # its coordinate subsets
])
def test_a_rule_rebuilt_from_its_state_continues_identically(name, options) -> None:
    first, *rest = buffers(1)
    original = create_aggregator(name, SIZE, **options)
    feed(original, first)
    feed(original, rest[0])
    state = original.state_dict()
    assert state and all(isinstance(v, np.ndarray) for v in state.values())
    rebuilt = create_aggregator(name, SIZE, **options)
    rebuilt.load_state_dict({k: v.copy() for k, v in state.items()})
    fresh = create_aggregator(name, SIZE, **options)
    for rows in rest[1:]:
        expected = feed(original, rows)
        np.testing.assert_array_equal(feed(rebuilt, rows), expected)
    # without the state the result differs: the test would notice a state that is not kept
    assert not np.array_equal(feed(fresh, rest[-1]), expected)


def test_sybil_state_keeps_histories_in_recency_order_within_max_clients() -> None:
    agg = create_aggregator("sybil", SIZE, dim=16, max_clients=3)
    for k, rows in enumerate(buffers(2, 2)):  # c0, c1, c2 then c2, c3, c4
        for i, row in enumerate(rows[:3]):
            agg.add(row, 1.0, client_id=f"c{2 * k + i}")
        agg.result()
        agg.reset()
    state = agg.state_dict()
    assert list(state["scorer.ids"]) == ["c2", "c3", "c4"]  # c0, c1 were evicted
    assert state["scorer.hist"].shape == (3, 16)
    other = create_aggregator("sybil", SIZE, dim=16, max_clients=3)
    other.load_state_dict(state)
    assert len(other.scorer) == 3 and "c4" in other.scorer and "c0" not in other.scorer


def test_stateless_rules_have_empty_state_and_refuse_foreign_state() -> None:
    agg = create_aggregator("fedavg", SIZE)
    assert agg.state_dict() == {}
    agg.load_state_dict({})
    with pytest.raises(AggregationError, match="keeps no state"):
        agg.load_state_dict({"centre": np.zeros(SIZE, np.float32)})
    clip = create_aggregator("centered-clip", SIZE)
    with pytest.raises(AggregationError, match="centre"):
        clip.load_state_dict({"centre": np.zeros(3, np.float32)})


def test_a_generator_state_must_be_six_words() -> None:
    agg = create_aggregator("flame", SIZE, noise=0.1)
    with pytest.raises(AggregationError, match="six uint64"):
        agg.load_state_dict({"rng": np.zeros(3, np.uint64)})
    with pytest.raises(AggregationError, match=r"generator \('rng'\) only"):
        agg.load_state_dict({"centre": np.zeros(6, np.uint64)})
