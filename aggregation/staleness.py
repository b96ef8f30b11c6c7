"""Staleness weights s(tau) for asynchronous aggregation.

tau is the number of global versions published between the version a client trained on and the
one its update meets. Every function here has s(0) = 1 and is non-increasing, so fresh updates
count fully. Forms from Xie et al., "Asynchronous Federated Optimization",
https://arxiv.org/abs/1903.03934 (constant, polynomial, hinge), as used by FedBuff.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

StalenessFn = Callable[[int], float]


@dataclass(frozen=True)
class Constant:
    """s(tau) = 1: staleness is ignored."""

    def __call__(self, tau: int) -> float:
        _check_tau(tau)
        return 1.0


@dataclass(frozen=True)
class Polynomial:
    """s(tau) = (1 + tau) ** -a; a = 0.5 is FedBuff's choice."""

    a: float = 0.5

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError(f"polynomial staleness exponent must be >= 0, got {self.a}")

    def __call__(self, tau: int) -> float:
        _check_tau(tau)
        return float((1.0 + tau) ** -self.a)


@dataclass(frozen=True)
class Hinge:
    """s(tau) = 1 for tau <= b, else 1 / (a (tau - b) + 1)."""

    a: float = 10.0
    b: int = 4

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0:
            raise ValueError(f"hinge staleness needs a >= 0 and b >= 0, got a={self.a} b={self.b}")

    def __call__(self, tau: int) -> float:
        _check_tau(tau)
        return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)


def _check_tau(tau: int) -> None:
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")


def staleness_function(name: str, **params: float) -> StalenessFn:
    """Build a staleness function by name: ``constant``, ``polynomial`` or ``hinge``."""
    if name == "constant":
        return Constant()
    if name == "polynomial":
        return Polynomial(**params)
    if name == "hinge":
        return Hinge(a=float(params.get("a", 10.0)), b=int(params.get("b", 4)))
    raise ValueError(f"unknown staleness function {name!r}; use constant, polynomial or hinge")
