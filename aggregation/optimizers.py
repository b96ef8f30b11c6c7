"""Server optimizers: how the aggregate client update moves the global model.

The aggregate update Delta (mean of client_model - global_model) is treated as a negative
pseudo-gradient. FedAvgM: Hsu et al., https://arxiv.org/abs/1909.06335. FedAdam and FedYogi:
Reddi et al., "Adaptive Federated Optimization", https://arxiv.org/abs/2003.00295 (Algorithm 2,
no bias correction, tau as the adaptivity floor).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import numpy.typing as npt

FlatVector = npt.NDArray[np.float32]


class ServerOptimizer(ABC):
    """Stateful rule ``params <- step(params, delta)``; state is saved with checkpoints."""

    name: ClassVar[str]

    @abstractmethod
    def step(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        """Return the new global parameters (a new array; ``params`` is not modified)."""

    def state_dict(self) -> dict[str, npt.NDArray[np.float32]]:
        return {}

    def load_state_dict(self, state: dict[str, npt.NDArray[np.float32]]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state, got {sorted(state)}")


class FedAvgOpt(ServerOptimizer):
    """params + lr * delta; lr = 1 is plain FedAvg."""

    name = "fedavg"

    def __init__(self, *, lr: float = 1.0) -> None:
        if not lr > 0:
            raise ValueError(f"server lr must be positive, got {lr}")
        self.lr = lr

    def step(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        if params.dtype != np.float32 or delta.dtype != np.float32:
            return (params + np.float32(self.lr) * delta).astype(np.float32, copy=False)
        # The same two float32 operations, into one new array instead of two: a model-sized
        # temporary costs a page fault per page at every version.
        out = delta * np.float32(self.lr) if self.lr != 1.0 else delta.copy()
        np.add(params, out, out=out)
        return out


class _Stateful(ServerOptimizer):
    _keys: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        self._state: dict[str, FlatVector] = {}

    def _buf(self, key: str, like: FlatVector) -> FlatVector:
        buf = self._state.get(key)
        if buf is None or buf.shape != like.shape:
            buf = self._state[key] = np.zeros_like(like, dtype=np.float32)
        return buf

    def state_dict(self) -> dict[str, FlatVector]:
        return {k: v.copy() for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, FlatVector]) -> None:
        unknown = set(state) - set(self._keys)
        if unknown:
            raise ValueError(f"{self.name}: unexpected state {sorted(unknown)}")
        self._state = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state.items()}


class FedAvgM(_Stateful):
    """Server momentum: m <- beta m + delta; params + lr m."""

    name = "fedavgm"
    _keys = ("momentum",)

    def __init__(self, *, lr: float = 1.0, beta: float = 0.9) -> None:
        super().__init__()
        if not lr > 0 or not 0 <= beta < 1:
            raise ValueError(f"fedavgm needs lr > 0 and 0 <= beta < 1, got lr={lr} beta={beta}")
        self.lr, self.beta = lr, beta

    def step(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        m = self._buf("momentum", params)
        m *= np.float32(self.beta)
        m += delta
        return (params + np.float32(self.lr) * m).astype(np.float32, copy=False)


class _Adaptive(_Stateful):
    _keys = ("m", "v")

    def __init__(self, *, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 1e-3) -> None:
        super().__init__()
        if not lr > 0 or not 0 <= beta1 < 1 or not 0 <= beta2 < 1 or not tau > 0:
            raise ValueError(f"{self.name} needs lr > 0, betas in [0, 1) and tau > 0")
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau

    @abstractmethod
    def _second_moment(self, v: FlatVector, d2: FlatVector) -> None: ...

    def step(self, params: FlatVector, delta: FlatVector) -> FlatVector:
        m, v = self._buf("m", params), self._buf("v", params)
        m *= np.float32(self.beta1)
        m += np.float32(1 - self.beta1) * delta
        self._second_moment(v, np.square(delta, dtype=np.float32))
        step = np.float32(self.lr) * m / (np.sqrt(v) + np.float32(self.tau))
        return (params + step).astype(np.float32, copy=False)


class FedAdam(_Adaptive):
    """Adam on the server: v <- beta2 v + (1 - beta2) delta^2."""

    name = "fedadam"

    def _second_moment(self, v: FlatVector, d2: FlatVector) -> None:
        v *= np.float32(self.beta2)
        v += np.float32(1 - self.beta2) * d2


class FedYogi(_Adaptive):
    """Yogi on the server: v <- v - (1 - beta2) delta^2 sign(v - delta^2)."""

    name = "fedyogi"

    def _second_moment(self, v: FlatVector, d2: FlatVector) -> None:
        v -= np.float32(1 - self.beta2) * d2 * np.sign(v - d2)


_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    cls.name: cls for cls in (FedAvgOpt, FedAvgM, FedAdam, FedYogi)
}


def create_optimizer(name: str, **params: float) -> ServerOptimizer:
    """Build a server optimizer by name: fedavg, fedavgm, fedadam or fedyogi."""
    try:
        cls = _OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown server optimizer {name!r}; available: {', '.join(sorted(_OPTIMIZERS))}"
        ) from None
    return cls(**params)  # type: ignore[call-arg]


def available_optimizers() -> list[str]:
    return sorted(_OPTIMIZERS)
