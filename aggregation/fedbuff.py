"""Buffered asynchronous aggregation (FedBuff).

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
https://arxiv.org/abs/2106.06639. Updates enter a buffer as they arrive, each scaled by its
staleness weight; every K updates the buffer yields one aggregate and empties.
"""

from __future__ import annotations

from collections.abc import Callable

from murmura.aggregation.base import AggregationError, Aggregator, FlatVector
from murmura.aggregation.fedavg import WeightedMean
from murmura.aggregation.staleness import Polynomial, StalenessFn


class StaleUpdateError(AggregationError):
    """The update is older than the buffer accepts."""


class FedBuff:
    """Aggregate every ``buffer_size`` updates; refuse updates staler than ``max_staleness``.

    The aggregate is sum_i n_i s(tau_i) u_i / sum_i n_i: staleness shrinks an update's share
    without renormalising, so with tau = 0 everywhere and K equal to a sync cohort one buffer
    step is exactly a FedAvg round.

    The buffer's rules (which staleness is refused, the factor an update is folded with, when
    the buffer is full) live in :meth:`admit` and :meth:`emptied`. :meth:`add` and
    :meth:`flush` fold and aggregate here; the server calls ``admit`` and ``emptied`` itself,
    because it folds into :attr:`aggregator` on its publisher thread, so both run the same
    rules.
    """

    def __init__(self, size: int, *, buffer_size: int, max_staleness: int,
                 staleness: StalenessFn | None = None,
                 aggregator: Callable[[int], Aggregator] = WeightedMean) -> None:
        if buffer_size < 1:
            raise AggregationError(f"buffer_size must be >= 1, got {buffer_size}")
        if max_staleness < 0:
            raise AggregationError(f"max_staleness must be >= 0, got {max_staleness}")
        self.buffer_size = buffer_size
        self.max_staleness = max_staleness
        self.staleness = staleness or Polynomial(0.5)
        self._agg = aggregator(size)
        self._admitted = 0  # updates admitted since the buffer last emptied

    def check(self, staleness: int) -> None:
        """Raise :class:`StaleUpdateError` if an update this stale would be refused."""
        if staleness < 0:
            raise AggregationError(f"staleness must be >= 0, got {staleness}")
        if staleness > self.max_staleness:
            raise StaleUpdateError(
                f"update is {staleness} versions old; the limit is {self.max_staleness}"
            )

    def admit(self, staleness: int, count: int = 1) -> tuple[float, bool]:
        """Admit ``count`` updates this stale (a leaf's partial aggregate carries several).

        Returns the staleness factor to fold them with and whether the buffer is now full;
        raises :class:`StaleUpdateError` (admitting nothing) for an update that is too old.
        """
        if count < 1:
            raise AggregationError(f"count must be >= 1, got {count}")
        self.check(staleness)
        self._admitted += count
        return self.staleness(staleness), self._admitted >= self.buffer_size

    def emptied(self) -> int:
        """Start the next buffer; returns how many updates the full one held."""
        count, self._admitted = self._admitted, 0
        return count

    def add(self, update: FlatVector, num_examples: float, staleness: int, *,
            client_id: str = "") -> bool:
        """Buffer one update; True when the buffer is full and :meth:`flush` should run."""
        factor, full = self.admit(staleness)
        self._agg.add(update, num_examples, factor=factor, client_id=client_id)
        return full

    def flush(self) -> FlatVector:
        """The buffered aggregate; the buffer empties."""
        out = self._agg.result()
        self._agg.reset()
        self.emptied()
        return out

    @property
    def count(self) -> int:
        """Updates admitted since the buffer last emptied."""
        return self._admitted

    @property
    def aggregator(self) -> Aggregator:
        """The rule the buffer folds into (a serverless tier folds into it directly)."""
        return self._agg
