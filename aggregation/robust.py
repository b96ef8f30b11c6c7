"""Byzantine-robust aggregation rules on flat float32 updates.

Every rule here needs the whole buffer at once, so each is a :class:`BufferedAggregator` whose
``result()`` calls a pure function of this module. Shared conventions:

* **Staleness.** Each update is multiplied by its ``factor`` *before* the robust statistic, so
  the rules see the same vectors FedAvg sums (sum_i w_i f_i u_i / sum_i w_i). With no clipping
  or trimming in play, ``clip`` and ``centered-clip`` equal FedAvg exactly.
* **Weights.** Example counts are reported by the clients, so an attacker can claim any number.
  Rules that vote (``median``, ``trimmed-mean``, Krum's selection) give every update one vote;
  rules that average (``clip``, ``centered-clip``, the mean of Multi-Krum's selection) use the
  weights, capped at ``weight_cap`` x the median weight (default 4; None disables), so that
  no client can buy the mean by claiming a huge example count.
* **Garbage.** Updates that are not finite (or whose squared norm overflows float32) are
  dropped before the statistic, and logged: no honest client sends them, and keeping them would
  let a single client turn the aggregate into NaN.
* **Cost.** All rules work on column blocks so that temporaries stay O(n x block). Krum's
  pairwise distances come from one Gram matrix (n x n), never from n^2 vector differences.
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import (
    AggregationError,
    BufferedAggregator,
    FlatVector,
    register_aggregator,
)
from murmura.aggregation.columns import THREADS, ColumnRunner, scale_into
from murmura.aggregation.robust_stats import (
    Floats,
    Stack,
    cap_weights,
    centered_clip,
    check_weight_cap,
    clip_scales,
    coordinate_median,
    huber_mean,
    krum_scores,
    pairwise_sq_distances,
    row_norms,
    state_array,
    trimmed_mean,
    weighted_median,
    weighted_sum,
)

__all__ = [
    "AdaptiveClipping",
    "CenteredClipping",
    "CoordinateMedian",
    "Krum",
    "MultiKrum",
    "RobustAggregator",
    "TrimmedMean",
    "cap_weights",
    "centered_clip",
    "clip_scales",
    "coordinate_median",
    "huber_mean",
    "krum_scores",
    "pairwise_sq_distances",
    "row_norms",
    "trimmed_mean",
    "weighted_median",
    "weighted_sum",
]

logger = logging.getLogger(__name__)


class RobustAggregator(BufferedAggregator):
    """Buffered rule that keeps factor-scaled updates in one (n, P) array, drops garbage, and
    hands the rest to ``_robust``.

    Rows are written into a preallocated array as they arrive (capacity doubles, and survives
    ``reset()``), so ``result()`` needs no second (n, P) copy: memory is n x P x 4 bytes, and
    pages are touched once, not every round. Rows are stored already multiplied by their
    staleness factor, which is all the rules need.

    ``columns`` runs the rule's per-coordinate work (aggregation/columns.py): threads by
    default; :meth:`use_columns` hands it, and the arrays it must read, to another runner.
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.columns: ColumnRunner = THREADS
        self._rows = np.empty((0, size), dtype=np.float32)

    def use_columns(self, runner: ColumnRunner) -> None:
        """Run the per-coordinate work with ``runner``; the buffers it reads move into arrays
        that ``runner`` allocated (their contents kept), so it can share them in place."""
        old, self.columns = self.columns, runner
        self._rows = self._in_runner(self._rows, old, len(self._weights))

    def _in_runner(self, array: npt.NDArray[np.float32], old: ColumnRunner,
                   used: int) -> npt.NDArray[np.float32]:
        """``array`` in an array of :attr:`columns` (its first ``used`` rows copied: the rest
        were never written); ``old``'s array is given back."""
        moved = self.columns.allocate(array.shape, array.dtype)
        moved[:used] = array[:used]
        old.release(array)
        return moved

    def add(self, update: FlatVector, weight: float, *, factor: float = 1.0,
            client_id: str = "") -> None:
        self._check(update, weight, factor)
        n = len(self._weights)
        if n == self._rows.shape[0]:
            grown = self.columns.allocate((max(16, 2 * n), self.size), np.float32)
            grown[:n] = self._rows[:n]
            self.columns.release(self._rows)
            self._rows = grown
        if self.columns is THREADS:
            np.multiply(update, np.float32(factor), out=self._rows[n], casting="unsafe")
        else:  # one job: a server's workers copy it in when the update is in shared memory
            self.columns.run(scale_into, {"src": update, "dst": self._rows},
                             (n, float(factor)), None, self.size, unit=max(self.size, 1))
        self._weights.append(float(weight))
        self._factors.append(float(factor))
        self._ids.append(client_id)

    @property
    def count(self) -> int:
        return len(self._weights)

    def result(self) -> FlatVector:
        if not self._weights:
            raise AggregationError("no updates to aggregate")
        return self._run(self._rows[: len(self._weights)],
                         np.asarray(self._weights, dtype=np.float64),
                         np.asarray(self._factors, dtype=np.float64), list(self._ids))

    def combine(self, updates: npt.NDArray[np.float32], weights: npt.NDArray[np.float64],
                factors: npt.NDArray[np.float64], client_ids: Sequence[str]) -> FlatVector:
        f = np.asarray(factors, dtype=np.float64)
        x = np.asarray(updates, dtype=np.float32) * f.astype(np.float32)[:, None]
        return self._run(x, np.asarray(weights, dtype=np.float64), f, list(client_ids))

    def _run(self, x: Stack, weights: Floats, factors: Floats, ids: list[str]) -> FlatVector:
        norms = row_norms(x, runner=self.columns)
        finite = np.isfinite(norms)
        if not finite.all():
            dropped = [ids[i] or f"#{i}" for i in np.flatnonzero(~finite)]
            logger.warning("%s: dropping %d non-finite update(s): %s",
                           self.name, len(dropped), ", ".join(dropped))
            if not finite.any():
                raise AggregationError("every update in the buffer is non-finite")
            x, weights, factors = x[finite], weights[finite], factors[finite]
            norms = norms[finite]
            ids = [i for i, ok in zip(ids, finite, strict=True) if ok]
        out = self._robust(x, weights, factors, norms, ids)
        return np.ascontiguousarray(out, dtype=np.float32)

    @abstractmethod
    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        """Aggregate the factor-scaled, finite rows ``x`` (read-only: the buffer itself)."""


class AdaptiveClipping(RobustAggregator):
    """Clip every update to ``multiplier`` x the median update norm, then take the weighted mean.

    Bounds a boosted or scaled update's pull to the bound times its weight share; says nothing
    about direction, so it is a first line, not a defence on its own. The median norm tolerates
    fewer than half of the updates being Byzantine; ``window > 1`` takes the median over the
    last ``window`` buffers' medians, so that a majority in one buffer cannot raise the bound.
    Adaptive bound as in Andrew et al., https://arxiv.org/abs/1905.03871 (quantile tracking),
    with the median chosen for robustness. Cost: one pass for norms and one for the sum.
    """

    name = "clip"

    def __init__(self, size: int, *, multiplier: float = 2.0, window: int = 1,
                 weight_cap: float | None = 4.0) -> None:
        super().__init__(size)
        check_weight_cap(weight_cap)
        self.weight_cap = weight_cap
        if not (math.isfinite(multiplier) and multiplier > 0):
            raise AggregationError(f"clip multiplier must be positive, got {multiplier}")
        if int(window) != window or window < 1:
            raise AggregationError(f"clip window must be an integer >= 1, got {window}")
        self.multiplier = float(multiplier)
        self.window = int(window)
        self._medians: deque[float] = deque(maxlen=self.window)
        self._recorded = False  # this buffer's median is in _medians (result() may run twice)

    def bound(self, norms: Floats) -> float:
        """Clipping bound for a buffer with these norms; the first call per buffer records it."""
        if not self._recorded:
            self._medians.append(float(np.median(norms)))
            self._recorded = True
        return self.multiplier * float(np.median(list(self._medians)))

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        w = cap_weights(weights, ratio=self.weight_cap)
        scales = clip_scales(norms, self.bound(norms))
        return weighted_sum(x, w * scales / w.sum(), runner=self.columns)

    def reset(self) -> None:
        super().reset()
        self._recorded = False

    def state_dict(self) -> dict[str, np.ndarray]:
        """The last ``window`` buffers' median norms."""
        return {"medians": np.array(self._medians, dtype=np.float64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        medians = state_array(state, "medians", self.name)
        self._medians = deque((float(m) for m in medians.ravel()), maxlen=self.window)


class CoordinateMedian(RobustAggregator):
    """Coordinate-wise median, one vote per update (weights are ignored).

    Tolerates fewer than half of the updates being Byzantine, per coordinate (Yin et al.,
    "Byzantine-Robust Distributed Learning", https://arxiv.org/abs/1803.01498). It is biased
    for skewed honest data and is weak against small coordinated shifts (ALIE). Cost: one
    selection per coordinate, O(n P).
    """

    name = "median"

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        return coordinate_median(x, runner=self.columns)


class TrimmedMean(RobustAggregator):
    """Coordinate-wise trimmed mean: drop floor(trim x n) values per side, average the rest.

    Tolerates up to floor(trim x n) Byzantine updates per side (Yin et al.,
    https://arxiv.org/abs/1803.01498). One vote per update (weights are ignored). Refuses a
    buffer where ``trim`` removes nothing (the rule would silently be the plain mean) or
    everything. Cost: one two-sided selection per coordinate, O(n P).
    """

    name = "trimmed-mean"

    def __init__(self, size: int, *, trim: float = 0.1) -> None:
        super().__init__(size)
        if not (math.isfinite(trim) and 0 < trim <= 0.5):
            raise AggregationError(f"trim must be a fraction in (0, 0.5], got {trim}")
        self.trim = float(trim)

    def trim_count(self, n: int) -> int:
        """Values dropped per side for n updates; raises if that is none or all of them."""
        k = math.floor(self.trim * n + 1e-9)
        if k == 0:
            raise AggregationError(
                f"trim={self.trim} of {n} updates removes none; the result would be the plain "
                f"mean. Use at least {math.ceil(1 / self.trim)} updates or a larger trim"
            )
        if n - 2 * k <= 0:
            raise AggregationError(
                f"trim={self.trim} removes {k} of {n} updates per side, leaving nothing to average"
            )
        return k

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        return trimmed_mean(x, trim_count=self.trim_count(x.shape[0]), runner=self.columns)


class MultiKrum(RobustAggregator):
    """Multi-Krum: average the ``m`` updates with the lowest Krum scores (weighted by examples).

    Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent",
    https://arxiv.org/abs/1703.02737. Tolerates f Byzantine updates when n > 2f + 2; ``m``
    defaults to n - f and may not exceed it (more would average in a Byzantine update). Assumes
    honest updates cluster, so it discards honest non-IID outliers too. Cost: one Gram matrix,
    O(n^2 P) flops, O(n^2) memory.
    """

    name = "multi-krum"

    def __init__(self, size: int, *, f: int = 1, m: int | None = None,
                 weight_cap: float | None = 4.0) -> None:
        super().__init__(size)
        check_weight_cap(weight_cap)
        self.weight_cap = weight_cap
        if int(f) != f or f < 0:
            raise AggregationError(f"krum f must be an integer >= 0, got {f}")
        if m is not None and (int(m) != m or m < 1):
            raise AggregationError(f"multi-krum m must be an integer >= 1, got {m}")
        self.f = int(f)
        self.m = None if m is None else int(m)

    def selected(self, x: Stack) -> npt.NDArray[np.intp]:
        """Indices of the rows this rule averages, best score first."""
        n = x.shape[0]
        if n <= 2 * self.f + 2:
            raise AggregationError(
                f"{self.name} with f={self.f} needs more than {2 * self.f + 2} updates, got {n}"
            )
        m = n - self.f if self.m is None else self.m
        if m > n - self.f:
            raise AggregationError(
                f"{self.name} with m={m} and f={self.f} would average {m} of {n} updates, "
                f"so it could include a Byzantine one; use m <= {n - self.f}"
            )
        return np.argsort(krum_scores(x, f=self.f, runner=self.columns), kind="stable")[:m]

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        sel = self.selected(x)
        coeff = np.zeros(len(weights))
        coeff[sel] = cap_weights(weights[sel], ratio=self.weight_cap)
        return weighted_sum(x, coeff / coeff.sum(), runner=self.columns)


class Krum(MultiKrum):
    """Krum: return the single update with the lowest Krum score.

    Blanchard et al., https://arxiv.org/abs/1703.02737: tolerates f Byzantine updates when
    n > 2f + 2. Using one update per round throws away the variance reduction of averaging,
    so it trains slower than Multi-Krum. Cost: one Gram matrix, O(n^2 P).
    """

    name = "krum"

    def __init__(self, size: int, *, f: int = 1) -> None:
        super().__init__(size, f=f, m=1)


class CenteredClipping(RobustAggregator):
    """Centred clipping around the previous aggregate (Karimireddy, He and Jaggi, 2021).

    "Learning from History for Byzantine Robust Optimization",
    https://arxiv.org/abs/2012.10333. Starting from the centre kept from earlier rounds, each
    iteration moves toward the weighted mean of the updates' differences, each clipped to
    radius ``tau``. A Byzantine fraction delta moves the result by at most about delta x tau per
    iteration, whatever the attackers send; the paper's guarantee needs delta < 0.5 and honest
    updates with bounded variance. ``tau=None`` sets tau to ``tau_scale`` x the weighted median
    distance to the centre each round, which keeps honest updates mostly unclipped.

    State that outlives ``reset()``: the centre, an exponential average of past results with
    coefficient ``momentum`` (0 re-centres on the last result, as in the paper). The paper's
    worker-side momentum would need one model-sized vector per client, so it is left to clients.
    Cost: two passes over the buffer per iteration.
    """

    name = "centered-clip"

    def __init__(self, size: int, *, tau: float | None = None, tau_scale: float = 2.0,
                 iterations: int = 3, momentum: float = 0.0,
                 weight_cap: float | None = 4.0) -> None:
        super().__init__(size)
        check_weight_cap(weight_cap)
        self.weight_cap = weight_cap
        if tau is not None and not (math.isfinite(tau) and tau > 0):
            raise AggregationError(f"centred clipping tau must be positive, got {tau}")
        if not (math.isfinite(tau_scale) and tau_scale > 0):
            raise AggregationError(f"centred clipping tau_scale must be positive, got {tau_scale}")
        if int(iterations) != iterations or iterations < 1:
            raise AggregationError(f"centred clipping iterations must be >= 1, got {iterations}")
        if not 0 <= momentum < 1:
            raise AggregationError(f"centred clipping momentum must be in [0, 1), got {momentum}")
        self.tau = None if tau is None else float(tau)
        self.tau_scale = float(tau_scale)
        self.iterations = int(iterations)
        self.momentum = float(momentum)
        self.centre = np.zeros(size, dtype=np.float32)
        self.last_tau = 0.0
        self._start = self.centre
        self._moved = False  # the centre already took this buffer's result

    def clip_around_centre(self, x: Stack, weights: Floats,
                           norms: Floats | None = None) -> FlatVector:
        """Run centred clipping for this buffer and (once per buffer) move the kept centre."""
        if not self._moved:
            self._start = self.centre
        out, self.last_tau = centered_clip(x, cap_weights(weights, ratio=self.weight_cap),
                                           centre=self._start, tau=self.tau, norms=norms,
                                           tau_scale=self.tau_scale, iterations=self.iterations)
        if not self._moved:
            self.centre = (np.float32(self.momentum) * self._start
                           + np.float32(1 - self.momentum) * out).astype(np.float32)
            self._moved = True
        return out

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        return self.clip_around_centre(x, weights, norms)

    def reset(self) -> None:
        super().reset()
        self._moved = False

    def state_dict(self) -> dict[str, np.ndarray]:
        """The centre (the last aggregate) and the last radius."""
        return {"centre": self.centre.copy(), "last_tau": np.array([self.last_tau])}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        centre = state_array(state, "centre", self.name)
        if centre.shape != (self.size,):
            raise AggregationError(f"centre has shape {centre.shape}, expected ({self.size},)")
        self.centre = self._start = centre.astype(np.float32, copy=True)
        self.last_tau = float(state.get("last_tau", np.zeros(1)).ravel()[0])


register_aggregator("clip", AdaptiveClipping)
register_aggregator("median", CoordinateMedian)
register_aggregator("trimmed-mean", TrimmedMean)
register_aggregator("krum", Krum)
register_aggregator("multi-krum", MultiKrum)
register_aggregator("centered-clip", CenteredClipping)
