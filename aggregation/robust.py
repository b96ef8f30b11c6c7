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
import os
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import torch

from murmura.aggregation.base import (
    AggregationError,
    BufferedAggregator,
    FlatVector,
    register_aggregator,
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

Floats = npt.NDArray[np.float64]
Stack = npt.NDArray[np.float32]

# Columns per block: 8192 x 1000 updates x 4 B = 32 MB of temporaries per block.
_BLOCK = 8192


# --------------------------------------------------------------------------- pure functions


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def row_norms(x: Stack) -> Floats:
    """Euclidean norm of each row; inf or NaN where a row is not finite or its square overflows."""
    sq = np.einsum("ij,ij->i", x, x)
    norms: Floats = np.sqrt(sq.astype(np.float64))
    return norms


def weighted_sum(x: Stack, coefficients: Floats) -> FlatVector:
    """sum_i c_i x_i as one matrix-vector product (float32, at memory bandwidth)."""
    c = torch.from_numpy(np.asarray(coefficients, dtype=np.float32))
    return (c @ _tensor(x)).numpy()


def weighted_median(values: Floats, weights: Floats) -> float:
    """Smallest value v with at least half the total weight on values <= v (lower median)."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    keep = weights > 0
    if not keep.any():
        raise AggregationError("weighted median of updates that all have zero weight")
    values, weights = values[keep], weights[keep]
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])


def cap_weights(weights: Floats, *, ratio: float | None) -> Floats:
    """min(w_i, ratio x median positive weight): no client can buy the mean by claiming examples."""
    w = np.asarray(weights, dtype=np.float64)
    positive = w[w > 0]
    if ratio is None or positive.size == 0:
        return w
    capped: Floats = np.minimum(w, ratio * float(np.median(positive)))
    return capped


def _state_array(state: dict[str, np.ndarray], key: str, rule: str) -> np.ndarray:
    if key not in state:
        raise AggregationError(f"state of rule {rule!r} lacks {key!r}; got {sorted(state)}")
    return np.asarray(state[key])


def _check_weight_cap(ratio: float | None) -> None:
    if ratio is not None and not (math.isfinite(ratio) and ratio >= 1):
        raise AggregationError(f"weight_cap must be None or a ratio >= 1, got {ratio}")


def clip_scales(norms: Floats, bound: float) -> Floats:
    """Per-row factor min(1, bound / norm), so that every scaled row has norm <= bound."""
    norms = np.asarray(norms, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(norms > bound, bound / norms, 1.0)
    return np.nan_to_num(scales, nan=0.0, posinf=0.0)


def _column_blocks(p: int, block: int = _BLOCK) -> list[tuple[int, int]]:
    return [(a, min(a + block, p)) for a in range(0, p, block)]


def _map_blocks(fn: Callable[[int, int], None], p: int) -> None:
    # numpy's partition releases the GIL, so two threads use both cores of a small server.
    blocks = _column_blocks(p)
    workers = min(len(blocks), os.cpu_count() or 1, 8)
    if workers <= 1:
        for a, b in blocks:
            fn(a, b)
        return
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(lambda ab: fn(*ab), blocks):
            pass


def coordinate_median(x: Stack, *, rows: npt.NDArray[np.intp] | None = None) -> FlatVector:
    """Coordinate-wise median (mean of the two middle values when n is even), O(n P).

    ``rows`` restricts it to those rows of ``x`` without copying the whole selection at once.
    """
    p = x.shape[1]
    n = x.shape[0] if rows is None else len(rows)
    if n == 0:
        raise AggregationError("median of no updates")
    lo, hi = (n - 1) // 2, n // 2
    out = np.empty(p, dtype=np.float32)

    def block(a: int, b: int) -> None:
        cols = np.ascontiguousarray((x[:, a:b] if rows is None else x[rows, a:b]).T)
        cols.partition([lo, hi] if hi != lo else lo, axis=1)
        out[a:b] = 0.5 * (cols[:, lo] + cols[:, hi]) if hi != lo else cols[:, lo]

    _map_blocks(block, p)
    return out


#: sigma = MAD_SCALE x MAD for Gaussian data (1 / Phi^-1(3/4)).
MAD_SCALE = 1.482602218505602


def huber_mean(x: Stack, *, c: float, weights: Floats | None = None,
               rows: npt.NDArray[np.intp] | None = None,
               stat_rows: npt.NDArray[np.intp] | None = None,
               extra: Stack | None = None,
               extra_rows: npt.NDArray[np.intp] | None = None,
               tail: int = 0, tail_c: float | None = None) -> FlatVector:
    """Per coordinate, the weighted mean of the values clipped to median +- c x sigma.

    sigma = 1.4826 x MAD (median absolute deviation from the median), both over ``stat_rows``
    (default: the averaged rows). This is one step of Huber's M-estimator of location with a
    robust scale, started at the median (Huber, "Robust Estimation of a Location Parameter",
    1964): where every value lies within c x sigma of the median it is the plain weighted mean;
    a row can move any coordinate by at most its weight share times (c x sigma + its distance
    to the median, clipped), whatever it sends; and where more than half the values agree
    exactly (sigma = 0), the result is that median value. The median and MAD break down only
    when half the ``stat_rows`` are outliers.

    ``rows`` picks the averaged rows of ``x`` (default all), ``weights`` their weights (default
    one each; the result divides by their sum). The ``extra_rows`` of ``extra`` (default all;
    read block by block, never gathered whole) join the median and the MAD but are not
    averaged: earlier updates that steady the statistic of a small buffer.
    One sort of the ``stat_rows`` (and ``extra``) per column block gives the median and the
    MAD (the smallest half-width of a window of sorted values that holds half of them, so no
    second selection), then one clamp-and-sum pass over ``rows``.
    The last ``tail`` coordinates are clipped with ``tail_c`` instead of ``c`` (a model's
    output layer, say).
    """
    for name, value in (("c", c), ("tail_c", c if tail_c is None else tail_c)):
        if not (math.isfinite(value) and value >= 0):
            raise AggregationError(f"huber clip {name} must be a finite number >= 0, got {value}")
    p = x.shape[1]
    if not 0 <= tail <= p:
        raise AggregationError(f"huber tail must hold 0..{p} coordinates, got {tail}")
    start_tail = p - tail if tail and tail_c is not None and tail_c != c else p
    take = np.arange(x.shape[0]) if rows is None else np.asarray(rows, dtype=np.intp)
    stat = take if stat_rows is None else np.asarray(stat_rows, dtype=np.intp)
    if extra is not None and (extra.ndim != 2 or extra.shape[1] != p):
        raise AggregationError(f"extra statistic rows have shape {extra.shape}, expected "
                               f"(k, {p})")
    more = (np.zeros(0, dtype=np.intp) if extra is None else np.arange(extra.shape[0])
            if extra_rows is None else np.asarray(extra_rows, dtype=np.intp))
    k = len(more)
    n, m = len(take), len(stat) + k
    if n == 0 or len(stat) == 0:
        raise AggregationError("huber mean of no updates")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not (np.all(w >= 0) and w.sum() > 0 and np.isfinite(w.sum())):
        raise AggregationError(f"huber mean needs {n} non-negative weights with a positive sum")
    coeff = torch.from_numpy((w / w.sum()).astype(np.float32))
    all_rows = n == x.shape[0] and rows is None
    same = stat_rows is None and k == 0
    lo_mid, hi_mid = (m - 1) // 2, m // 2
    half = m // 2 + 1  # the MAD is the half-th smallest absolute deviation
    bound = np.float32(c * MAD_SCALE)
    bound_tail = np.float32((c if tail_c is None else tail_c) * MAD_SCALE)
    out = np.empty(p, dtype=np.float32)

    def block(a: int, b: int) -> None:
        vals = x[:, a:b] if all_rows else x[take, a:b]
        if same:
            sel = vals
        elif extra is not None and k:
            sel = np.concatenate([x[stat, a:b], extra[more, a:b]])
        else:
            sel = x[stat, a:b]
        srt = np.ascontiguousarray(sel.T)
        srt.sort(axis=1)
        med = 0.5 * (srt[:, lo_mid] + srt[:, hi_mid])
        # Sorted values: any `half` of them closest to the median are consecutive, so the MAD
        # is min over windows s[i..i+half-1] of max(med - s[i], s[i+half-1] - med).
        left = med[:, None] - srt[:, : m - half + 1]
        np.maximum(left, srt[:, half - 1:] - med[:, None], out=left)
        if b <= start_tail:
            radius = left.min(axis=1) * bound
        else:  # this block reaches the tail: its columns from start_tail on use tail_c
            scale = np.full(b - a, bound, dtype=np.float32)
            scale[max(start_tail - a, 0):] = bound_tail
            radius = left.min(axis=1) * scale
        lo = torch.from_numpy(med - radius)
        hi = torch.from_numpy(med + radius)
        clipped = torch.clamp(torch.from_numpy(vals), min=lo, max=hi)
        out[a:b] = (coeff @ clipped).numpy()

    _map_blocks(block, p)
    return out


def trimmed_mean(x: Stack, *, trim_count: int) -> FlatVector:
    """Per coordinate, drop the ``trim_count`` largest and smallest values and average the rest."""
    n, p = x.shape
    k = trim_count
    if k < 0 or n - 2 * k <= 0:
        raise AggregationError(f"trimming {k} per side from {n} updates leaves nothing to average")
    if k == 0:
        return (x.sum(axis=0, dtype=np.float64) / n).astype(np.float32)
    out = np.empty(p, dtype=np.float32)

    def block(a: int, b: int) -> None:
        cols = np.ascontiguousarray(x[:, a:b].T)
        cols.partition([k, n - 1 - k] if n - 1 - k != k else k, axis=1)
        out[a:b] = cols[:, k : n - k].sum(axis=1, dtype=np.float64) / (n - 2 * k)

    _map_blocks(block, p)
    return out


def pairwise_sq_distances(x: Stack) -> Floats:
    """(n, n) squared Euclidean distances from one Gram matrix, O(n^2 P) flops, O(n^2) memory.

    Rows are first centred on the row of median norm: distances do not change, but the Gram
    entries of ordinary rows stay small, so float32 cancellation stays at the scale of the
    honest spread even when one row is enormous. Entries that overflow become +inf.
    """
    n, p = x.shape
    norms = row_norms(x)
    centre = _tensor(x[int(np.argsort(norms, kind="stable")[(n - 1) // 2])])
    xt = _tensor(x)
    gram = torch.zeros((n, n), dtype=torch.float32)
    for a, b in _column_blocks(p, 4 * _BLOCK):
        y = xt[:, a:b] - centre[a:b]
        gram += y @ y.T
    g = gram.numpy().astype(np.float64)
    g = 0.5 * (g + g.T)
    diag = np.diag(g)
    with np.errstate(invalid="ignore", over="ignore"):
        d2 = diag[:, None] + diag[None, :] - 2.0 * g
    d2 = np.nan_to_num(d2, nan=np.inf, posinf=np.inf)
    np.maximum(d2, 0.0, out=d2)
    np.fill_diagonal(d2, 0.0)
    return d2


def krum_scores(x: Stack, *, f: int) -> Floats:
    """Krum score of each row: sum of squared distances to its n - f - 2 nearest other rows."""
    n = x.shape[0]
    k = n - f - 2
    if f < 0 or k < 1:
        raise AggregationError(f"krum needs n > 2f + 2 updates; got n={n} with f={f}")
    d2 = pairwise_sq_distances(x)
    np.fill_diagonal(d2, np.inf)
    nearest = np.partition(d2, k - 1, axis=1)[:, :k]
    scores: Floats = nearest.sum(axis=1)
    return scores


def centered_clip(x: Stack, weights: Floats, *, centre: FlatVector, tau: float | None,
                  tau_scale: float, iterations: int, votes: Floats | None = None,
                  scales: Floats | None = None,
                  norms: Floats | None = None) -> tuple[FlatVector, float]:
    """Centred clipping: v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i, ``iterations`` times.

    ``tau=None`` picks the radius from the data: ``tau_scale`` times the median distance of the
    rows to the starting centre, so that most honest rows are not clipped. The median counts
    ``votes`` (default: one per row of positive weight), never the claimed example counts,
    which an attacker could inflate to set the radius. ``scales`` multiplies the rows (e.g. norm
    clipping) without copying them; ``norms`` (of the unscaled rows) saves a pass if known.
    Returns the new centre and the radius used.
    """
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if not total > 0:
        raise AggregationError("centred clipping needs a positive total weight")
    votes = (w > 0).astype(np.float64) if votes is None else np.asarray(votes, np.float64)
    row_scales = np.ones(len(w)) if scales is None else np.asarray(scales, np.float64)
    row_norms_ = row_norms(x) if norms is None else np.asarray(norms, np.float64)
    xt = _tensor(x)
    v = np.array(centre, dtype=np.float32, copy=True)
    radius = tau
    for _ in range(iterations):
        dist = _distances_to(xt, v, row_scales, row_norms_)
        if radius is None:
            radius = tau_scale * weighted_median(dist, votes)
        coeff = w * clip_scales(dist, radius) / total
        # sum_i c_i (x_i - v) = (c @ X) - (sum_i c_i) v
        v = v + (weighted_sum(x, coeff * row_scales) - np.float32(coeff.sum()) * v)
    return v.astype(np.float32, copy=False), float(radius if radius is not None else 0.0)


def _distances_to(xt: torch.Tensor, v: FlatVector, scales: Floats, norms: Floats) -> Floats:
    """||s_i x_i - v|| for every row, from one matrix-vector product.

    ||s x - v||^2 = s^2 ||x||^2 - 2 s x.v + ||v||^2 cancels badly when s x is within a few
    percent of v; those rows (rare: honest updates are rarely that close to the last aggregate)
    are recomputed directly, block by block.
    """
    vt = torch.from_numpy(v)
    dots = (xt @ vt).numpy().astype(np.float64)
    sx2 = (scales * norms) ** 2
    v2 = float(np.dot(v.astype(np.float64), v.astype(np.float64)))
    sq = sx2 - 2.0 * scales * dots + v2
    risky = np.flatnonzero(~(sq > 1e-3 * (sx2 + v2)))
    if risky.size:
        rows = torch.from_numpy(risky)
        st = torch.from_numpy(scales[risky].astype(np.float32))[:, None]
        exact = torch.zeros(risky.size, dtype=torch.float64)
        for a, b in _column_blocks(xt.shape[1], 4 * _BLOCK):
            diff = xt[rows, a:b] * st - vt[a:b]
            exact += torch.einsum("ij,ij->i", diff, diff).double()
        sq[risky] = exact.numpy()
    dist: Floats = np.sqrt(np.maximum(sq, 0.0))
    return dist


# --------------------------------------------------------------------------- aggregators


class RobustAggregator(BufferedAggregator):
    """Buffered rule that keeps factor-scaled updates in one (n, P) array, drops garbage, and
    hands the rest to ``_robust``.

    Rows are written into a preallocated array as they arrive (capacity doubles, and survives
    ``reset()``), so ``result()`` needs no second (n, P) copy: memory is n x P x 4 bytes, and
    pages are touched once, not every round. Rows are stored already multiplied by their
    staleness factor, which is all the rules need.
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._rows = np.empty((0, size), dtype=np.float32)

    def add(self, update: FlatVector, weight: float, *, factor: float = 1.0,
            client_id: str = "") -> None:
        self._check(update, weight, factor)
        n = len(self._weights)
        if n == self._rows.shape[0]:
            grown = np.empty((max(8, 2 * n), self.size), dtype=np.float32)
            grown[:n] = self._rows[:n]
            self._rows = grown
        np.multiply(update, np.float32(factor), out=self._rows[n], casting="unsafe")
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
        norms = row_norms(x)
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
        _check_weight_cap(weight_cap)
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
        return weighted_sum(x, w * scales / w.sum())

    def reset(self) -> None:
        super().reset()
        self._recorded = False

    def state_dict(self) -> dict[str, np.ndarray]:
        """The last ``window`` buffers' median norms."""
        return {"medians": np.array(self._medians, dtype=np.float64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        medians = _state_array(state, "medians", self.name)
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
        return coordinate_median(x)


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
        return trimmed_mean(x, trim_count=self.trim_count(x.shape[0]))


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
        _check_weight_cap(weight_cap)
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
        return np.argsort(krum_scores(x, f=self.f), kind="stable")[:m]

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        sel = self.selected(x)
        coeff = np.zeros(len(weights))
        coeff[sel] = cap_weights(weights[sel], ratio=self.weight_cap)
        return weighted_sum(x, coeff / coeff.sum())


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
        _check_weight_cap(weight_cap)
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
        centre = _state_array(state, "centre", self.name)
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
