"""Seed mode's catch-up: a model snapshot plus the step logs mixed since.

In seed mode a round ends with ``base + mean(updates)``, each update the replay of a step log
(a seed and a scalar per step) on the round's base. A peer that keeps the model of some round
(its *snapshot*) and the step logs it mixed in every round since can therefore rebuild its
current model bit for bit, and so can anyone who holds the snapshot and receives the logs: a
joining or restarted peer catches up for a few KiB per round instead of a model ("Just One
Byte", Zelikman et al. 2023, https://arxiv.org/abs/2306.05374). Every peer of a run starts from
the same seeded model, so the first snapshot is one every peer already holds.

The journal is bounded: past ``max_rounds`` rounds or ``max_bytes`` of logs, the oldest round
is replayed into the snapshot and dropped. Pure code: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from murmura.protocols import FlatVector

__all__ = ["Decode", "RoundLogs", "StepJournal", "digest", "mean_step", "replay"]

#: (payload, base) -> the update the step log replays to on ``base``.
Decode = Callable[[bytes, FlatVector], FlatVector]
#: One round's mixed step logs: (round, [(peer id, payload), ...] in peer-id order).
RoundLogs = tuple[int, list[tuple[str, bytes]]]


def mean_step(base: FlatVector, updates: Sequence[FlatVector]) -> FlatVector:
    """``base`` + the mean of ``updates``, summed in the order given: the one arithmetic a
    mixing peer and a replaying peer share, so both get the same bits."""
    total = np.zeros_like(base)
    for u in updates:
        total += u
    return (base + total / np.float32(len(updates))).astype(np.float32)


def replay(model: FlatVector, rounds: Sequence[RoundLogs], decode: Decode) -> FlatVector:
    """The model after mixing ``rounds`` in order, starting from ``model``."""
    for _, logs in rounds:
        base = model
        model = mean_step(base, [decode(payload, base) for _, payload in logs])
    return model


def digest(model: FlatVector) -> bytes:
    """SHA-256 of a model's little-endian float32 bytes (a snapshot's identity)."""
    return hashlib.sha256(np.ascontiguousarray(model, dtype="<f4").tobytes()).digest()


class StepJournal:
    """A snapshot and the rounds of step logs mixed since (see the module docstring)."""

    def __init__(self, snapshot_round: int, snapshot: FlatVector, decode: Decode, *,
                 max_rounds: int = 50, max_bytes: int = 192 * 1024) -> None:
        if max_rounds < 1 or max_bytes < 1:
            raise ValueError("max_rounds and max_bytes must be >= 1")
        self.decode, self.max_rounds, self.max_bytes = decode, max_rounds, max_bytes
        self.snapshot_round = snapshot_round
        self.snapshot = np.array(snapshot, dtype=np.float32, copy=True)
        self.rounds: OrderedDict[int, list[tuple[str, bytes]]] = OrderedDict()
        self.bytes = 0

    def record(self, round_: int, logs: Sequence[tuple[str, bytes]]) -> None:
        """The step logs mixed in ``round_`` (any order: kept in peer-id order)."""
        if self.rounds and round_ <= next(reversed(self.rounds)):
            raise ValueError(f"round {round_} is not after the journal's last round")
        kept = sorted((str(p), bytes(b)) for p, b in logs)
        self.rounds[round_] = kept
        self.bytes += sum(len(b) for _, b in kept)
        while len(self.rounds) > 1 and (len(self.rounds) > self.max_rounds
                                        or self.bytes > self.max_bytes):
            oldest, logs_ = self.rounds.popitem(last=False)
            self.snapshot = replay(self.snapshot, [(oldest, logs_)], self.decode)
            self.snapshot_round = next(iter(self.rounds))
            self.bytes -= sum(len(b) for _, b in logs_)

    def rebase(self, round_: int, model: FlatVector) -> None:
        """Start over from ``model`` at ``round_`` (after a jump the logs do not explain)."""
        self.snapshot_round = round_
        self.snapshot = np.array(model, dtype=np.float32, copy=True)
        self.rounds.clear()
        self.bytes = 0

    def adopt(self, snapshot_round: int, snapshot: FlatVector,
              rounds: Sequence[RoundLogs]) -> None:
        """Take another peer's journal as this peer's own (after catching up from it)."""
        self.rebase(snapshot_round, snapshot)
        for r, logs in rounds:
            self.record(r, logs)

    def entries(self) -> list[RoundLogs]:
        return [(r, list(logs)) for r, logs in self.rounds.items()]

    def current(self) -> FlatVector:
        """The model the journal explains: the snapshot with every round replayed."""
        return replay(self.snapshot, self.entries(), self.decode)
