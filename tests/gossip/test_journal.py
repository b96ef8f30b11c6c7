"""Seed mode's journal: a snapshot plus the step logs since rebuild a peer's model exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.gossip.journal import StepJournal, digest, mean_step, replay

SIZE = 16


def _decode(payload: bytes, base: np.ndarray) -> np.ndarray:
    """A stand-in for the seed codec: the payload seeds a direction scaled by the base."""
    rng = np.random.default_rng(int.from_bytes(payload[:8], "little"))
    return (rng.standard_normal(SIZE).astype(np.float32) * np.float32(0.01)
            * (1 + np.abs(base).mean(dtype=np.float32)))


def _logs(round_: int, peers: int) -> list[tuple[str, bytes]]:
    return [(f"p{k}", (round_ * 100 + k).to_bytes(8, "little")) for k in range(peers)]


def _mix(model: np.ndarray, logs: list[tuple[str, bytes]]) -> np.ndarray:
    """What a mixing peer computes (sorted by peer id, as PeerNode does)."""
    return mean_step(model, [_decode(p, model) for _, p in sorted(logs)])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(1, 6), st.integers(1, 400))
def test_the_journal_rebuilds_the_model_exactly_however_it_was_trimmed(
        rounds: int, peers: int, max_rounds: int, max_bytes: int) -> None:
    start = np.linspace(-1, 1, SIZE, dtype=np.float32)
    journal = StepJournal(0, start, _decode, max_rounds=max_rounds, max_bytes=max_bytes)
    model = start
    for r in range(rounds):
        logs = _logs(r, peers)
        model = _mix(model, list(reversed(logs)))  # arrival order does not matter
        journal.record(r, logs)

    assert len(journal.rounds) <= max_rounds and len(journal.rounds) >= 1
    np.testing.assert_array_equal(journal.current(), model)
    # what a catching-up peer does with the journal's snapshot and entries
    np.testing.assert_array_equal(replay(journal.snapshot, journal.entries(), _decode), model)
    assert journal.snapshot_round == next(iter(journal.rounds))


def test_rounds_must_increase_and_rebase_starts_over() -> None:
    start = np.zeros(SIZE, dtype=np.float32)
    journal = StepJournal(0, start, _decode)
    journal.record(3, _logs(3, 2))
    with pytest.raises(ValueError, match="not after"):
        journal.record(3, _logs(3, 2))
    journal.rebase(7, np.ones(SIZE, dtype=np.float32))
    assert journal.snapshot_round == 7 and not journal.rounds
    assert digest(journal.current()) == digest(np.ones(SIZE, dtype=np.float32))
    with pytest.raises(ValueError):
        StepJournal(0, start, _decode, max_rounds=0)
