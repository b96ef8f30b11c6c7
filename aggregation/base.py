"""The aggregator interface and its registry.

An aggregator folds client updates in as they arrive (``add``) and produces one aggregate update
(``result``). Linear rules such as the weighted mean keep O(model) memory; rules that need every
update of a round at once (median, Krum, Sybil scoring) subclass :class:`BufferedAggregator`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

FlatVector = npt.NDArray[np.float32]


class AggregationError(ValueError):
    """An aggregator was misused or misconfigured; the message says how."""


class Aggregator(ABC):
    """Fold updates in one at a time; ``result()`` gives the aggregate of what was added.

    ``weight`` is the update's share in the mean (usually its number of examples); ``factor``
    scales the update's contribution without changing the normaliser, which is how staleness
    discounts enter (FedBuff: stale updates shrink the step instead of being renormalised away).
    """

    name: ClassVar[str]
    #: True for a rule whose aggregate can be computed from merged partial aggregates (a
    #: weighted sum, its total weight and a count), so a hierarchy of aggregators gives the
    #: flat result; such rules offer ``partial()`` and ``merge()``. Robust and Sybil-resistant
    #: rules need the whole buffer of updates and stay False.
    decomposable: ClassVar[bool] = False

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise AggregationError(f"model size must be positive, got {size}")
        self.size = size

    @abstractmethod
    def add(self, update: FlatVector, weight: float, *, factor: float = 1.0,
            client_id: str = "") -> None:
        """Take one update into the aggregate."""

    @abstractmethod
    def result(self) -> FlatVector:
        """The aggregate of everything added since the last reset (a new array)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything added."""

    @property
    @abstractmethod
    def count(self) -> int:
        """How many updates were added since the last reset."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """What the rule carries from one aggregate to the next (not the buffer), as named
        arrays, so a restarted server resumes with it; empty for a stateless rule."""
        return {}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Take back what :meth:`state_dict` gave (from a rule with the same options)."""
        if state:
            raise AggregationError(f"rule {self.name!r} keeps no state, got {sorted(state)}")

    def _check(self, update: FlatVector, weight: float, factor: float) -> None:
        if update.shape != (self.size,):
            raise AggregationError(f"update has shape {update.shape}, expected ({self.size},)")
        if not (np.isfinite(weight) and weight > 0):
            raise AggregationError(f"weight must be positive and finite, got {weight}")
        if not (np.isfinite(factor) and factor >= 0):
            raise AggregationError(f"factor must be non-negative and finite, got {factor}")


class BufferedAggregator(Aggregator):
    """Base for rules that need the whole set of updates: keeps them until ``result()``."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._updates: list[FlatVector] = []
        self._weights: list[float] = []
        self._factors: list[float] = []
        self._ids: list[str] = []

    def add(self, update: FlatVector, weight: float, *, factor: float = 1.0,
            client_id: str = "") -> None:
        self._check(update, weight, factor)
        self._updates.append(np.array(update, dtype=np.float32, copy=True))
        self._weights.append(float(weight))
        self._factors.append(float(factor))
        self._ids.append(client_id)

    def result(self) -> FlatVector:
        if not self._updates:
            raise AggregationError("no updates to aggregate")
        return self.combine(np.stack(self._updates), np.asarray(self._weights),
                            np.asarray(self._factors), list(self._ids))

    @abstractmethod
    def combine(self, updates: npt.NDArray[np.float32], weights: npt.NDArray[np.float64],
                factors: npt.NDArray[np.float64], client_ids: Sequence[str]) -> FlatVector:
        """Aggregate a (n, size) stack of updates."""

    def reset(self) -> None:
        self._updates.clear()
        self._weights.clear()
        self._factors.clear()
        self._ids.clear()

    @property
    def count(self) -> int:
        return len(self._updates)


AggregatorFactory = Callable[..., Aggregator]
_REGISTRY: dict[str, AggregatorFactory] = {}


def register_aggregator(name: str, factory: AggregatorFactory) -> None:
    """Make ``factory(size, **options)`` available as ``name``; duplicates fail loudly."""
    if name in _REGISTRY:
        raise AggregationError(f"aggregator {name!r} is already registered")
    _REGISTRY[name] = factory


def aggregation_rule(name: str) -> Callable[[AggregatorFactory], AggregatorFactory]:
    """Decorator form of :func:`register_aggregator`, so an app file can define a rule and
    make it selectable by name (``--defense NAME``) in one place."""
    def register(factory: AggregatorFactory) -> AggregatorFactory:
        register_aggregator(name, factory)
        return factory
    return register


def create_aggregator(name: str, size: int, **options: Any) -> Aggregator:
    """Build the aggregator registered as ``name`` for vectors of ``size`` values."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise AggregationError(
            f"unknown aggregator {name!r}; available: {', '.join(available_aggregators())}"
        ) from None
    return factory(size, **options)


def aggregator_factory(name: str) -> AggregatorFactory:
    """The factory registered as ``name``; its keyword parameters are the rule's options."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AggregationError(
            f"unknown aggregator {name!r}; available: {', '.join(available_aggregators())}"
        ) from None


def available_aggregators() -> list[str]:
    return sorted(_REGISTRY)
