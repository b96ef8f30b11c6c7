"""How an aggregate becomes the next global model: a server optimizer, or a seed pool.

The core does not branch on the kind of run: it asks its :class:`ModelRule` to advance the
model by an aggregate, to say what a checkpoint must keep, and (seed-pool runs) for the pool's
base and scalars. ``advance`` runs on the publisher thread, never on the gRPC event loop; it
returns a new vector and leaves the previous one untouched, because clients may still be
streaming it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from murmura.aggregation import ServerOptimizer
from murmura.protocols import FlatVector
from murmura.server.pool import PoolState


class ModelRule(ABC):
    """Turns aggregates into global models and says what a checkpoint keeps."""

    @abstractmethod
    def advance(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        """The next global model from the current one and the aggregate (a new array).

        Raise ValueError to drop the aggregate; the global model then stays as it is.
        """

    @abstractmethod
    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
        """``(optimizer_state, meta, extra)`` for :class:`~murmura.server.Checkpoint`."""


class OptimizerRule(ModelRule):
    """x ← optimizer.step(x, Δ): FedAvg (x + ηΔ), FedAvgM, FedAdam or FedYogi."""

    def __init__(self, optimizer: ServerOptimizer) -> None:
        self.optimizer = optimizer

    def advance(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        new = self.optimizer.step(params, delta)
        if not np.isfinite(np.add.reduce(new, dtype=np.float64)):
            raise ValueError("the server optimizer's step made the global model non-finite")
        return new

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
        return self.optimizer.state_dict(), {}, {}


class PoolRule(ModelRule):
    """FedKSeed: aggregates are K pool coordinates added to the cumulative scalars."""

    def __init__(self, state: PoolState, *, lr: float) -> None:
        self.state = state
        self.lr = lr

    def advance(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        return self.state.advance(delta, lr=self.lr)

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
        pool = self.state.pool
        return {}, {"pool": {"k": len(pool), "base_seed": pool.base_seed}}, self.state.arrays()


__all__ = ["ModelRule", "OptimizerRule", "PoolRule"]
