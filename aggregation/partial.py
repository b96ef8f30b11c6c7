"""Mergeable partial aggregates: the state a leaf aggregator passes up a hierarchy.

A hierarchy of aggregators (leaves fold their clients, a parent merges the leaves' partial
aggregates) computes the same weighted mean as one flat aggregator, up to float32 rounding:
float addition is not associative, so the grouping changes the last bits. :class:`Partial` is
the mergeable state of a decomposable rule (weighted sum, total weight, count); its sum is
either a float32 vector (fast; merges agree within a stated tolerance) or an :class:`ExactSum`
(:mod:`murmura.aggregation.exact_sum`), whose result is bit-identical whatever the order of
additions and merges, so a three-level hierarchy, one worker or N workers all publish exactly
the flat run's model. The exact sum's names are re-exported here, where callers import them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError, FlatVector
from murmura.aggregation.exact_sum import (
    EXACT_LIMIT,
    LIMB_BITS,
    QUANTUM_BITS,
    ExactSum,
    exact_mean,
)

__all__ = ["EXACT_LIMIT", "LIMB_BITS", "QUANTUM_BITS", "ExactSum", "Partial", "exact_mean"]


@dataclass(frozen=True, eq=False)
class Partial:
    """The mergeable state of a decomposable rule: a weighted sum, its total weight, a count.

    A leaf aggregator folds its clients' updates and pushes ``Partial`` (via
    :meth:`WeightedMean.partial`) to its parent, which folds it in with
    :meth:`WeightedMean.merge`, as in LIFL's hierarchical aggregation (Qi, Ramakrishnan & Lee,
    MLSys 2024, https://arxiv.org/abs/2405.10968). ``sum`` is a float32 vector (the fast
    path) or an :class:`ExactSum` (order-independent, bit-identical); ``weight`` is a float, or
    the exact :class:`fractions.Fraction` of an exact sum. Operations return new partials and
    never change their inputs.

    Float32 tolerance: a float32 sum built from n contributions through any tree of adds and
    merges is within gamma(n + 1 + 2 s) * sum_i |w_i f_i u_i| of the exact sum, where s is the
    largest number of scalings (``scaled`` or a merge with a factor) on one contribution's way
    up, gamma(k) = k u / (1 - k u), u = 2**-24: each contribution sees the rounding of w * f to
    float32 and of its product, at most n - 1 additions, and two roundings per scaling (the
    factor to float32, the product). Two trees therefore differ by at most twice that; the
    tests use s = 1, gamma(n + 4).
    """

    sum: FlatVector | ExactSum
    weight: float | Fraction
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise AggregationError(f"count must be an integer >= 0, got {self.count!r}")
        if isinstance(self.sum, ExactSum):
            if not isinstance(self.weight, Fraction):
                raise AggregationError("an exact partial's weight must be a Fraction, got "
                                       f"{type(self.weight).__name__}")
            if self.weight != self.sum.total_weight or self.count != self.sum.count:
                raise AggregationError(
                    f"partial weight {self.weight} and count {self.count} disagree with its "
                    f"exact sum's ({self.sum.total_weight}, {self.sum.count})")
        else:
            s = self.sum
            if not isinstance(s, np.ndarray) or s.dtype != np.float32 or s.ndim != 1 \
                    or s.size == 0:
                raise AggregationError("a partial's sum must be a non-empty 1-d float32 array "
                                       "or an ExactSum")
            if isinstance(self.weight, Fraction):
                raise AggregationError("a float32 partial's weight is a float, not a Fraction")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise AggregationError(f"weight must be finite and >= 0, got {self.weight}")
        if (self.count == 0) != (self.weight == 0):
            raise AggregationError(f"an empty partial has count 0 and weight 0, got count "
                                   f"{self.count} and weight {self.weight}")

    @property
    def exact(self) -> bool:
        return isinstance(self.sum, ExactSum)

    @property
    def size(self) -> int:
        return self.sum.size

    @classmethod
    def empty(cls, size: int, *, exact: bool = False) -> Partial:
        """The neutral element of :meth:`merge`."""
        if exact:
            return cls(ExactSum(size), Fraction(0), 0)
        if size <= 0:
            raise AggregationError(f"size must be positive, got {size}")
        return cls(np.zeros(size, dtype=np.float32), 0.0, 0)

    @classmethod
    def from_arrays(cls, *, weight: float, count: int, sum_f32: npt.ArrayLike | None = None,
                    limbs: tuple[npt.ArrayLike, npt.ArrayLike] | None = None) -> Partial:
        """Build from plain arrays (a decoded wire payload); copies and validates them."""
        if (sum_f32 is None) == (limbs is None):
            raise AggregationError("give exactly one of sum_f32 and limbs")
        if limbs is not None:
            return cls(ExactSum.from_limbs(*limbs, weight=weight, count=count),
                       Fraction(weight), int(count))
        vector = np.array(sum_f32, dtype=np.float32, copy=True)
        if vector.ndim == 1 and vector.size and not np.isfinite(vector).all():
            bad = int(np.flatnonzero(~np.isfinite(vector))[0])
            raise AggregationError(f"partial sum holds {vector[bad]} at index {bad}")
        return cls(vector, float(weight), count)

    def as_arrays(self) -> dict[str, Any]:
        """``weight``, ``count`` and ``sum_f32`` or ``limbs``: the inverse of
        :meth:`from_arrays`, and the keyword arguments of ``encode_partial``."""
        out: dict[str, Any] = {"weight": float(self.weight), "count": self.count}
        if isinstance(self.sum, ExactSum):
            out["limbs"] = self.sum.limbs()
        else:
            out["sum_f32"] = self.sum
        return out

    def merge(self, other: Partial) -> Partial:
        """The partial of both sets of updates."""
        self._check_compatible(other)
        if isinstance(self.sum, ExactSum):
            assert isinstance(other.sum, ExactSum)
            total = self.sum.copy()
            total.merge(other.sum)
            return Partial(total, total.total_weight, total.count)
        assert not isinstance(other.sum, ExactSum)
        return Partial(self.sum + other.sum, float(self.weight) + float(other.weight),
                       self.count + other.count)

    def scaled(self, factor: float) -> Partial:
        """The partial with its sum times ``factor`` (weight and count unchanged): how a stale
        partial is discounted as a whole at its parent, as a stale update is."""
        f = float(factor)
        if not (math.isfinite(f) and f >= 0):
            raise AggregationError(f"factor must be non-negative and finite, got {factor}")
        if isinstance(self.sum, ExactSum):
            return Partial(self.sum.scaled(f), self.weight, self.count)
        with np.errstate(over="ignore"):
            vector = np.multiply(self.sum, f, dtype=np.float64).astype(np.float32)
        if not np.isfinite(vector).all():
            raise AggregationError(f"scaling by {f} overflows float32")
        return Partial(vector, self.weight, self.count)

    def mean(self) -> FlatVector:
        """sum / weight as float32: what the partial's aggregator would publish."""
        if self.count == 0:
            raise AggregationError("no updates to aggregate")
        if isinstance(self.sum, ExactSum):
            return exact_mean(self.sum)
        return (self.sum / np.float32(self.weight)).astype(np.float32, copy=False)

    def _check_compatible(self, other: Partial) -> None:
        if not isinstance(other, Partial):
            raise AggregationError(f"can only merge a Partial, got {type(other).__name__}")
        if other.size != self.size:
            raise AggregationError(f"partial has {other.size} values, expected {self.size}")
        if other.exact != self.exact:
            raise AggregationError("cannot merge an exact partial with a float32 one: build "
                                   "every aggregator of the hierarchy with the same exact=")
