"""The robust statistics behind the Byzantine-robust rules, as pure functions on stacks of
flat float32 updates (``n x P``): norms, weighted sums and medians, the coordinate median,
the Huber mean, the trimmed mean, Krum's scores and centred clipping.

They work on column blocks so that temporaries stay O(n x block), and Krum's pairwise
distances come from one Gram matrix (n x n), never from n^2 vector differences. The rules in
:mod:`murmura.aggregation.robust` call them; the Sybil and filtering rules reuse some.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from murmura.aggregation.base import AggregationError, FlatVector
from murmura.aggregation.columns import BLOCK, THREADS, UNIT, ColumnRunner, blocks

__all__ = [
    "Floats",
    "HuberParams",
    "Stack",
    "check_weight_cap",
    "state_array",
    "MAD_SCALE",
    "cap_weights",
    "centered_clip",
    "clip_scales",
    "coordinate_median",
    "huber_block",
    "huber_mean",
    "median_block",
    "krum_scores",
    "gram_unit",
    "pairwise_sq_distances",
    "row_norms",
    "squares_unit",
    "trimmed_block",
    "trimmed_mean",
    "weighted_median",
    "weighted_sum",
    "weighted_sum_block",
]

Floats = npt.NDArray[np.float64]
Stack = npt.NDArray[np.float32]

_BLOCK = BLOCK  # columns per block (aggregation/columns.py)


# --------------------------------------------------------------------------- pure functions


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def row_norms(x: Stack, *, runner: ColumnRunner = THREADS) -> Floats:
    """Euclidean norm of each row; inf or NaN where a row is not finite or its square overflows
    float32. Squares are summed in float32 per :data:`~murmura.aggregation.columns.UNIT`
    columns and the partials in float64, in order, so ``runner`` can split the work."""
    n, p = x.shape
    units = max(-(-p // UNIT), 1)
    parts = np.zeros((units, n), dtype=np.float64)
    if p:
        runner.run(squares_unit, {"x": x}, None, parts, p, unit=UNIT)
    sq = parts[0].copy()
    for part in parts[1:]:
        sq += part
    sq[sq > np.finfo(np.float32).max] = np.inf  # as a float32 sum of squares would overflow
    norms: Floats = np.sqrt(sq)
    return norms


def squares_unit(arrays: Mapping[str, np.ndarray | None], params: None, out: np.ndarray,
                 a: int, b: int) -> None:
    """Kernel of :func:`row_norms`: each row's sum of squares over columns ``a..b`` (one unit)."""
    x = arrays["x"]
    assert x is not None
    out[a // UNIT] = np.einsum("ij,ij->i", x[:, a:b], x[:, a:b])


def weighted_sum(x: Stack, coefficients: Floats, *, runner: ColumnRunner = THREADS
                 ) -> FlatVector:
    """sum_i c_i x_i as one matrix-vector product (float32, at memory bandwidth); another
    ``runner`` than the threads takes it block by block (each column is the same dot product
    of n values either way: the same bits, which a test checks)."""
    c = np.asarray(coefficients, dtype=np.float32)
    if runner is THREADS:
        return (torch.from_numpy(c) @ _tensor(x)).numpy()
    out = np.empty(x.shape[1], dtype=np.float32)
    runner.run(weighted_sum_block, {"x": x}, c, out, x.shape[1])
    return out


def weighted_sum_block(arrays: Mapping[str, np.ndarray | None], c: npt.NDArray[np.float32],
                       out: np.ndarray, a: int, b: int) -> None:
    """Kernel of :func:`weighted_sum` for columns ``a..b``."""
    x = arrays["x"]
    assert x is not None
    out[a:b] = (torch.from_numpy(c) @ torch.from_numpy(x[:, a:b])).numpy()


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


def state_array(state: dict[str, np.ndarray], key: str, rule: str) -> np.ndarray:
    if key not in state:
        raise AggregationError(f"state of rule {rule!r} lacks {key!r}; got {sorted(state)}")
    return np.asarray(state[key])


def check_weight_cap(ratio: float | None) -> None:
    if ratio is not None and not (math.isfinite(ratio) and ratio >= 1):
        raise AggregationError(f"weight_cap must be None or a ratio >= 1, got {ratio}")


def clip_scales(norms: Floats, bound: float) -> Floats:
    """Per-row factor min(1, bound / norm), so that every scaled row has norm <= bound."""
    norms = np.asarray(norms, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(norms > bound, bound / norms, 1.0)
    return np.nan_to_num(scales, nan=0.0, posinf=0.0)


def coordinate_median(x: Stack, *, rows: npt.NDArray[np.intp] | None = None,
                      runner: ColumnRunner = THREADS) -> FlatVector:
    """Coordinate-wise median (mean of the two middle values when n is even), O(n P).

    ``rows`` restricts it to those rows of ``x`` without copying the whole selection at once;
    ``runner`` runs the column blocks (aggregation/columns.py).
    """
    p = x.shape[1]
    n = x.shape[0] if rows is None else len(rows)
    if n == 0:
        raise AggregationError("median of no updates")
    out = np.empty(p, dtype=np.float32)
    runner.run(median_block, {"x": x}, None if rows is None else np.asarray(rows, np.intp),
               out, p)
    return out


def median_block(arrays: Mapping[str, np.ndarray | None], rows: npt.NDArray[np.intp] | None,
                 out: np.ndarray, a: int, b: int) -> None:
    """Kernel of :func:`coordinate_median` for columns ``a..b``."""
    x = arrays["x"]
    assert x is not None
    n = x.shape[0] if rows is None else len(rows)
    lo, hi = (n - 1) // 2, n // 2
    cols = np.ascontiguousarray((x[:, a:b] if rows is None else x[rows, a:b]).T)
    cols.partition([lo, hi] if hi != lo else lo, axis=1)
    out[a:b] = 0.5 * (cols[:, lo] + cols[:, hi]) if hi != lo else cols[:, lo]


#: sigma = MAD_SCALE x MAD for Gaussian data (1 / Phi^-1(3/4)).
MAD_SCALE = 1.482602218505602


def huber_mean(x: Stack, *, c: float, weights: Floats | None = None,
               rows: npt.NDArray[np.intp] | None = None,
               stat_rows: npt.NDArray[np.intp] | None = None,
               extra: Stack | None = None,
               extra_rows: npt.NDArray[np.intp] | None = None,
               tail: int = 0, tail_c: float | None = None,
               runner: ColumnRunner = THREADS) -> FlatVector:
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
    take = np.arange(x.shape[0]) if rows is None else np.asarray(rows, dtype=np.intp)
    stat = take if stat_rows is None else np.asarray(stat_rows, dtype=np.intp)
    if extra is not None and (extra.ndim != 2 or extra.shape[1] != p):
        raise AggregationError(f"extra statistic rows have shape {extra.shape}, expected "
                               f"(k, {p})")
    more = (np.zeros(0, dtype=np.intp) if extra is None else np.arange(extra.shape[0])
            if extra_rows is None else np.asarray(extra_rows, dtype=np.intp))
    n = len(take)
    if n == 0 or len(stat) == 0:
        raise AggregationError("huber mean of no updates")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not (np.all(w >= 0) and w.sum() > 0 and np.isfinite(w.sum())):
        raise AggregationError(f"huber mean needs {n} non-negative weights with a positive sum")
    params = HuberParams(
        coeff=(w / w.sum()).astype(np.float32), take=take, stat=stat, more=more,
        all_rows=n == x.shape[0] and rows is None, same=stat_rows is None and len(more) == 0,
        bound=float(np.float32(c * MAD_SCALE)),
        bound_tail=float(np.float32((c if tail_c is None else tail_c) * MAD_SCALE)),
        start_tail=p - tail if tail and tail_c is not None and tail_c != c else p)
    out = np.empty(p, dtype=np.float32)
    runner.run(huber_block, {"x": x, "extra": extra if len(more) else None}, params, out, p)
    return out


@dataclass(frozen=True)
class HuberParams:
    """What :func:`huber_block` needs besides the rows: small, so it travels to a worker."""

    coeff: npt.NDArray[np.float32]  # each averaged row's weight share
    take: npt.NDArray[np.intp]  # the averaged rows of x
    stat: npt.NDArray[np.intp]  # the rows of x in the statistic
    more: npt.NDArray[np.intp]  # the rows of extra in the statistic
    all_rows: bool  # take is every row of x, in order
    same: bool  # the statistic is over exactly the averaged rows
    bound: float  # c x MAD_SCALE, as float32
    bound_tail: float  # tail_c x MAD_SCALE
    start_tail: int  # the first column clipped with bound_tail (p: none)


def huber_block(arrays: Mapping[str, np.ndarray | None], params: HuberParams,
                out: np.ndarray, a: int, b: int) -> None:
    """:func:`huber_mean` for columns ``a..b``: ``arrays`` holds ``x`` and ``extra``."""
    x, extra = arrays["x"], arrays["extra"]
    assert x is not None
    q = params
    m = len(q.stat) + len(q.more)
    lo_mid, hi_mid = (m - 1) // 2, m // 2
    half = m // 2 + 1  # the MAD is the half-th smallest absolute deviation
    bound, bound_tail = np.float32(q.bound), np.float32(q.bound_tail)
    vals = x[:, a:b] if q.all_rows else x[q.take, a:b]
    if q.same:
        sel = vals
    elif extra is not None:
        sel = np.concatenate([x[q.stat, a:b], extra[q.more, a:b]])
    else:
        sel = x[q.stat, a:b]
    srt = np.ascontiguousarray(sel.T)
    srt.sort(axis=1)
    med = 0.5 * (srt[:, lo_mid] + srt[:, hi_mid])
    # Sorted values: any `half` of them closest to the median are consecutive, so the MAD
    # is min over windows s[i..i+half-1] of max(med - s[i], s[i+half-1] - med).
    left = med[:, None] - srt[:, : m - half + 1]
    np.maximum(left, srt[:, half - 1:] - med[:, None], out=left)
    if b <= q.start_tail:
        radius = left.min(axis=1) * bound
    else:  # this block reaches the tail: its columns from start_tail on use tail_c
        scale = np.full(b - a, bound, dtype=np.float32)
        scale[max(q.start_tail - a, 0):] = bound_tail
        radius = left.min(axis=1) * scale
    lo = torch.from_numpy(med - radius)
    hi = torch.from_numpy(med + radius)
    clipped = torch.clamp(torch.from_numpy(vals), min=lo, max=hi)
    out[a:b] = (torch.from_numpy(q.coeff) @ clipped).numpy()


def trimmed_mean(x: Stack, *, trim_count: int, runner: ColumnRunner = THREADS) -> FlatVector:
    """Per coordinate, drop the ``trim_count`` largest and smallest values and average the rest."""
    n, p = x.shape
    k = trim_count
    if k < 0 or n - 2 * k <= 0:
        raise AggregationError(f"trimming {k} per side from {n} updates leaves nothing to average")
    if k == 0:
        return (x.sum(axis=0, dtype=np.float64) / n).astype(np.float32)
    out = np.empty(p, dtype=np.float32)
    runner.run(trimmed_block, {"x": x}, k, out, p)
    return out


def trimmed_block(arrays: Mapping[str, np.ndarray | None], k: int, out: np.ndarray,
                  a: int, b: int) -> None:
    """Kernel of :func:`trimmed_mean` for columns ``a..b`` (``k`` trimmed per side)."""
    x = arrays["x"]
    assert x is not None
    n = x.shape[0]
    cols = np.ascontiguousarray(x[:, a:b].T)
    cols.partition([k, n - 1 - k] if n - 1 - k != k else k, axis=1)
    out[a:b] = cols[:, k : n - k].sum(axis=1, dtype=np.float64) / (n - 2 * k)


def pairwise_sq_distances(x: Stack, *, runner: ColumnRunner = THREADS) -> Floats:
    """(n, n) squared Euclidean distances from one Gram matrix, O(n^2 P) flops, O(n^2) memory.

    Rows are first centred on the row of median norm: distances do not change, but the Gram
    entries of ordinary rows stay small, so float32 cancellation stays at the scale of the
    honest spread even when one row is enormous. Entries that overflow become +inf. The Gram
    matrix is summed in float32 per :data:`~murmura.aggregation.columns.UNIT` columns (which
    ``runner`` may spread) and the units' partials in float64, in order.
    """
    n, p = x.shape
    norms = row_norms(x, runner=runner)
    centre = int(np.argsort(norms, kind="stable")[(n - 1) // 2])
    parts = np.zeros((max(-(-p // UNIT), 1), n, n), dtype=np.float32)
    if p:
        runner.run(gram_unit, {"x": x}, centre, parts, p, unit=UNIT)
    g = parts[0].astype(np.float64)
    for part in parts[1:]:
        g += part
    g = 0.5 * (g + g.T)
    diag = np.diag(g)
    with np.errstate(invalid="ignore", over="ignore"):
        d2 = diag[:, None] + diag[None, :] - 2.0 * g
    d2 = np.nan_to_num(d2, nan=np.inf, posinf=np.inf)
    np.maximum(d2, 0.0, out=d2)
    np.fill_diagonal(d2, 0.0)
    return d2


def gram_unit(arrays: Mapping[str, np.ndarray | None], centre: int, out: np.ndarray,
              a: int, b: int) -> None:
    """Kernel of :func:`pairwise_sq_distances`: the Gram matrix of columns ``a..b`` (one
    unit) of the rows less row ``centre``, summed in float32 over 32,768-column steps."""
    x = arrays["x"]
    assert x is not None
    xt = torch.from_numpy(x)
    c = xt[centre]
    gram = torch.zeros((x.shape[0], x.shape[0]), dtype=torch.float32)
    for lo in range(a, b, 4 * BLOCK):
        hi = min(lo + 4 * BLOCK, b)
        y = xt[:, lo:hi] - c[lo:hi]
        gram += y @ y.T
    out[a // UNIT] = gram.numpy()


def krum_scores(x: Stack, *, f: int, runner: ColumnRunner = THREADS) -> Floats:
    """Krum score of each row: sum of squared distances to its n - f - 2 nearest other rows."""
    n = x.shape[0]
    k = n - f - 2
    if f < 0 or k < 1:
        raise AggregationError(f"krum needs n > 2f + 2 updates; got n={n} with f={f}")
    d2 = pairwise_sq_distances(x, runner=runner)
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
        for a, b in blocks(xt.shape[1], 4 * BLOCK):
            diff = xt[rows, a:b] * st - vt[a:b]
            exact += torch.einsum("ij,ij->i", diff, diff).double()
        sq[risky] = exact.numpy()
    dist: Floats = np.sqrt(np.maximum(sq, 0.0))
    return dist


# --------------------------------------------------------------------------- aggregators
