"""FedKSeed on the server: the global model kept as a base plus K cumulative pool scalars.

Implementation based on FedKSeed, Qin et al., "Federated Full-Parameter Tuning of Billion-Sized
Language Models with Communication Cost under 18 Kilobytes", https://arxiv.org/abs/2312.06353.

When every zeroth-order client draws its step seeds from one shared pool of K seeds, every
update is a combination of the same K directions, so the server can aggregate in those K
coordinates: each update becomes the K-vector of coefficients it applied along each pool seed
(:meth:`SeedPool.contribution`), the round's aggregate is a K-vector, and the server adds it
(times ``server_lr``) to a float64 running sum ``S``. The global model is *defined* as
``pool_model(base, pool, float32(S))``, the K canonical steps of ``apply_pool`` applied to the
base model the pool started from. A client that holds the base therefore rebuilds the exact
global model, bit for bit, from K downloaded float32 numbers, however many versions it missed.

Cost: each new version replays up to K directions over the whole model (K times the work of one
zeroth-order step), on the server and on each client that catches up. Pick K so that is cheap
next to local training; FedKSeed uses K = 1024 to 4096.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from murmura.protocols import FlatVector
from murmura.protocols.codecs.seed import SeedPool, ZOSteps, pool_model


class PoolState:
    """The pool, its base model and the cumulative coefficients; one per pool run."""

    def __init__(self, pool: SeedPool, base: FlatVector, *, base_version: int = 0,
                 cumulative: npt.NDArray[np.float64] | None = None) -> None:
        self.pool = pool
        self.base = np.array(base, dtype=np.float32, copy=True)
        self.base.setflags(write=False)
        self.base_version = base_version
        if cumulative is None:
            cumulative = np.zeros(len(pool), dtype=np.float64)
        if cumulative.shape != (len(pool),) or not np.isfinite(cumulative).all():
            raise ValueError(f"pool state needs {len(pool)} finite cumulative scalars, got "
                             f"shape {cumulative.shape}")
        self.cumulative = np.array(cumulative, dtype=np.float64, copy=True)
        self._scalars = self._publishable()

    def __len__(self) -> int:
        return len(self.pool)

    def _publishable(self) -> npt.NDArray[np.float32]:
        scalars = self.cumulative.astype(np.float32)
        if not np.isfinite(scalars).all():
            raise ValueError("a cumulative pool scalar overflows float32")
        scalars.setflags(write=False)
        return scalars

    @property
    def scalars(self) -> npt.NDArray[np.float32]:
        """What clients download: float32(S), K values (read-only; replaced, never modified)."""
        return self._scalars

    def contribution(self, steps: ZOSteps) -> FlatVector:
        """One update in pool coordinates (CodecError when a step seed is not a pool seed)."""
        return self.pool.contribution(steps).astype(np.float32)

    def model(self) -> FlatVector:
        """The global model the current scalars define."""
        return pool_model(self.base, self.pool, self._scalars)

    def advance(self, delta: FlatVector, *, lr: float) -> FlatVector:
        """Add ``lr * delta`` (an aggregate in pool coordinates) and return the new model.

        Nothing changes when the new sums would not fit float32, so a wild aggregate cannot
        leave the state half-updated.
        """
        if delta.shape != (len(self.pool),):
            raise ValueError(f"pool aggregate has shape {delta.shape}, expected "
                             f"({len(self.pool)},)")
        old = self.cumulative
        self.cumulative = old + float(lr) * delta.astype(np.float64)
        try:
            self._scalars = self._publishable()
        except ValueError:
            self.cumulative = old
            raise
        return self.model()

    def arrays(self) -> dict[str, np.ndarray]:
        """What a checkpoint must keep to resume this state."""
        return {"pool.base": self.base, "pool.cumulative": self.cumulative,
                "pool.base_version": np.array([self.base_version], dtype=np.int64)}


__all__ = ["PoolState"]
