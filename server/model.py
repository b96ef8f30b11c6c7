"""How an aggregate becomes the next global model: a server optimizer, or a seed pool.

The core does not branch on the kind of run: it asks its :class:`ModelRule` to advance the
model by an aggregate, to say what a checkpoint must keep, and (seed-pool runs) for the pool's
base and scalars. ``advance`` runs on the publisher thread, never on the gRPC event loop; it
returns a new vector and leaves the previous one untouched, because clients may still be
streaming it.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from murmura.aggregation import ServerOptimizer
from murmura.protocols import FlatVector, ModelSpec
from murmura.server.pool import PoolState

if TYPE_CHECKING:
    from murmura.server.decoding import Decoded

log = logging.getLogger(__name__)


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


class BufferRule:
    """Buffers (BatchNorm running statistics) are averaged, never stepped.

    A buffer is an estimate the clients measured, not a parameter: a server step with
    ``server_lr`` > 1, momentum, an adaptive step, FedCompass's extrapolated step or a stale
    delta (an update trained on version 3 added to version 7) all push it past anything a client
    measured, e.g. ``running_var`` below zero, and evaluation turns NaN. So the new version's
    buffers are the examples-weighted mean of the clients' own values (the buffers of the
    version each trained on plus its delta): no staleness weight, step scale or server
    optimizer. Variances are then clamped at zero (only rounding can take them there).

    :meth:`take` runs on the publisher before an update is folded: it re-bases the update's
    buffer part on the model the aggregate is applied to (a leaf: the version it forwards on),
    so a leaf's partial carries values its parent can average too, and adds it to the mean.
    :meth:`settle` writes the mean into the new version; the aggregate's buffer part is zeroed
    first (:meth:`without`), so optimizer state never moves there.
    """

    def __init__(self, spec: ModelSpec, params: FlatVector, version: int, *, keep: int) -> None:
        self.index = spec.buffer_index
        self.variances = spec.variance_index
        self._keep = max(keep, 1)
        self._lock = threading.Lock()  # remember() may run on the owner's thread (a leaf)
        self._values: OrderedDict[int, FlatVector] = OrderedDict()
        self._sum = np.zeros(len(self.index), dtype=np.float64)
        self._weight = 0.0
        self._missing = False
        self.remember(version, params)

    @classmethod
    def for_spec(cls, spec: ModelSpec, params: FlatVector, version: int, *,
                 keep: int) -> BufferRule | None:
        """The rule for a model with buffers (None: the vector is all parameters)."""
        if len(spec.buffer_index) == 0:
            return None
        return cls(spec, params, version, keep=keep)

    def remember(self, version: int, params: FlatVector) -> None:
        """Keep version ``version``'s buffers: updates trained on it are re-based with them."""
        with self._lock:
            self._values[version] = params[self.index].copy()
            while len(self._values) > self._keep:
                self._values.popitem(last=False)

    def take(self, decoded: Decoded, current: FlatVector, *, accumulate: bool = True) -> None:
        """Re-base ``decoded``'s buffer part on ``current`` and add it to the mean."""
        with self._lock:
            base = self._values.get(decoded.base_version) if decoded.base_version is not None \
                else None
        shift = None
        if base is not None:
            shift = base - current[self.index]
        elif decoded.base_version is not None and not self._missing:  # e.g. replayed
            # after a restart, when the versions before it are gone
            self._missing = True
            log.warning("buffers of version %s are no longer kept: an update trained on it "
                        "enters the buffer mean as a delta on the current model",
                        decoded.base_version)
        if decoded.is_partial:
            weight = float(decoded.weight or 0.0)
            if decoded.values is None:  # an exact partial: its limbs stay as they are
                total = decoded.as_partial().mean() * weight
                part = np.asarray(total, dtype=np.float64)[self.index]
                if shift is not None:
                    part += weight * shift
            else:
                part = self._shifted(decoded, shift, weight)
        else:
            weight = float(decoded.examples)
            part = self._shifted(decoded, shift, 1.0) * weight
        if accumulate and weight > 0:
            self._sum += part
            self._weight += weight

    def _shifted(self, decoded: Decoded, shift: FlatVector | None,
                 weight: float) -> np.ndarray:
        """The buffer part of ``decoded.values`` re-based in place (a read-only array is
        copied first); returned as float64."""
        values = decoded.values
        assert values is not None
        if shift is not None:
            if not values.flags.writeable:
                values = decoded.values = values.copy()
            values[self.index] += np.float32(weight) * shift
        return values[self.index].astype(np.float64)

    def without(self, delta: FlatVector) -> FlatVector:
        """The aggregate with its buffer part zeroed: what the server optimizer may step."""
        if not delta.flags.writeable:
            delta = delta.copy()
        delta[self.index] = 0.0
        return delta

    def settle(self, params: FlatVector, current: FlatVector) -> None:
        """Write the mean of the clients' buffers into the new version ``params`` (in place;
        without any, the buffers stay as in ``current``) and start the next mean."""
        if self._weight > 0:
            params[self.index] = current[self.index] + self._sum / self._weight
        else:
            params[self.index] = current[self.index]
        params[self.variances] = np.maximum(params[self.variances], 0.0)
        self.reset()

    def reset(self) -> None:
        """Forget what was taken since the last version (a dropped or forwarded aggregate)."""
        self._sum.fill(0.0)
        self._weight = 0.0


__all__ = ["BufferRule", "ModelRule", "OptimizerRule", "PoolRule"]
