"""Pure functions on update directions: cosine matrices, FLAME's majority cluster,
Divide-and-Conquer's outlier test and the spectral z-scores of the collusion screen. Used by
:mod:`murmura.aggregation.filtering`, :mod:`murmura.aggregation.collusion` and the default rule
in :mod:`murmura.aggregation.sybil`.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError

__all__ = ["cosine_matrix", "dnc_outliers", "linkage_group", "majority_cluster", "spectral_z",
           "unit_rows"]

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]


def unit_rows(x: npt.ArrayLike) -> Floats:
    """Rows scaled to unit length (zero rows stay zero)."""
    a = np.atleast_2d(np.asarray(x, dtype=np.float64))
    norms = np.linalg.norm(a, axis=1, keepdims=True)
    out: Floats = np.divide(a, norms, out=np.zeros_like(a), where=norms > 0)
    return out


def cosine_matrix(x: npt.ArrayLike) -> Floats:
    """(n, n) cosine similarities of the rows of ``x``, clipped to [-1, 1]."""
    u = unit_rows(x)
    out: Floats = np.clip(u @ u.T, -1.0, 1.0)
    return out


def majority_cluster(distances: npt.ArrayLike, *, min_size: int | None = None) -> Mask:
    """Members of the first single-linkage component to reach ``min_size`` points.

    ``distances`` is a symmetric (n, n) matrix; ``min_size`` defaults to n // 2 + 1, FLAME's
    HDBSCAN setting, under which this component is the one cluster HDBSCAN can select and its
    members are the points it labels (the others are its outliers). Ties in distance merge in
    index order, so the result is deterministic.
    """
    return linkage_group(distances, min_size=min_size)[0]


def linkage_group(distances: npt.ArrayLike, *, min_size: int | None = None
                  ) -> tuple[Mask, float]:
    """:func:`majority_cluster` and the height at which it formed: the distance of the
    single-linkage merge that brought it to ``min_size`` points (0 when no merge was needed).

    Every point within that height of a member belongs to the group, so the height also
    decides which *other* points (not in the matrix) would have joined it: those whose
    nearest member is no farther (see the default rule's direction stage).
    """
    d = np.asarray(distances, dtype=np.float64)
    n = d.shape[0]
    if d.shape != (n, n) or n == 0:
        raise AggregationError(f"expected a square distance matrix, got shape {d.shape}")
    size = n // 2 + 1 if min_size is None else int(min_size)
    if not 1 <= size <= n:
        raise AggregationError(f"min_size must be in [1, {n}], got {size}")
    if size == 1 or n == 1:
        return np.ones(n, dtype=bool), 0.0
    parent = np.arange(n)
    count = np.ones(n, dtype=np.int64)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    iu, ju = np.triu_indices(n, k=1)
    w = np.nan_to_num(d[iu, ju], nan=np.inf)
    for e in np.argsort(w, kind="stable"):
        a, b = root(int(iu[e])), root(int(ju[e]))
        if a == b:
            continue
        if count[a] < count[b]:
            a, b = b, a
        parent[b] = a
        count[a] += count[b]
        if count[a] >= size:
            roots = np.fromiter((root(i) for i in range(n)), dtype=np.intp, count=n)
            mask: Mask = roots == a
            return mask, float(w[e])
    return np.ones(n, dtype=bool), math.inf  # unreachable: n points always merge into one


def dnc_outliers(x: npt.ArrayLike, *, f: int, c: float = 1.0, iterations: int = 5,
                 subsample: int = 10_000, rng: np.random.Generator) -> Mask:
    """Divide-and-Conquer's kept set: True for rows never among the ``c x f`` largest outlier
    scores (squared projection on the top singular vector of the centred rows, over a random
    subset of ``subsample`` coordinates), in any of ``iterations`` draws. When every row was
    flagged in some draw (a large ``c x f`` against few rows), the rows flagged least often
    are kept: the set is never empty."""
    a = np.asarray(x)
    n, p = a.shape
    if f < 0 or c <= 0 or iterations < 1:
        raise AggregationError(f"dnc needs f >= 0, c > 0 and iterations >= 1; got {f}, {c}, "
                               f"{iterations}")
    drop = min(n - 1, int(math.floor(c * f)))
    flagged = np.zeros(n, dtype=np.int64)
    if drop <= 0:
        return flagged == 0
    for _ in range(iterations):
        cols = rng.choice(p, size=min(subsample, p), replace=False) if subsample < p else None
        sub = (a if cols is None else a[:, np.sort(cols)]).astype(np.float64)
        centred = sub - sub.mean(axis=0)
        # Top right-singular vector from the small (n x n) Gram matrix.
        vals, vecs = np.linalg.eigh(centred @ centred.T)
        top = vecs[:, -1] * math.sqrt(max(vals[-1], 0.0))  # = centred @ v for unit v
        scores = top**2
        flagged[np.argsort(scores, kind="stable")[n - drop:]] += 1
    return flagged == flagged.min()


def spectral_z(rows: npt.ArrayLike) -> Floats:
    """Robust z-score of each row along the rows' top principal direction.

    The rows are centred on their coordinate-wise median, projected on the top right singular
    vector of the centred matrix, and each projection is scored as (p - median(p)) / (1.4826 x
    MAD(p)), one vote per row. The direction's sign is chosen so that the farthest row sits on
    the positive side. A group that shares one direction the others do not (colluding
    clients' common objective) dominates the top singular vector and lands together in the
    positive tail; without such a group, the top direction is the largest honest variation and
    the scores look like draws from a symmetric distribution. Each row is projected on the
    direction made by the other rows (first-order leave-one-out), so one row unlike all the
    others, which alone makes the top direction when rows outnumber nothing, is not scored as a
    group. The test is Divide-and-Conquer's
    (Shejwalkar and Houmansadr, NDSS 2021) with a robust threshold instead of a fixed number
    of rows to drop. Fewer than 3 rows, or rows that do not vary, score 0.
    """
    a = np.asarray(rows, dtype=np.float64)
    if a.ndim != 2:
        raise AggregationError(f"expected a (rows, dim) matrix, got shape {a.shape}")
    n = a.shape[0]
    if n < 3:
        return np.zeros(n)
    centred = a - np.median(a, axis=0)
    if not np.any(centred):
        return np.zeros(n)
    # Top singular vector from the small (n x n) Gram matrix G: the top direction is
    # v = sum_j u_j c_j / sqrt(lam) for G's top eigenvector u. Row i is scored against the
    # direction the *other* rows make, sum_{j != i} G_ij u_j / sqrt(lam) = (lam - G_ii) u_i
    # / sqrt(lam): a lone outlier that alone makes the top direction (lam ~ G_ii) scores ~0,
    # while members of a group that shares it keep their score.
    gram = centred @ centred.T
    vals, vecs = np.linalg.eigh(gram)
    lam = max(float(vals[-1]), 0.0)
    if not lam > 0:
        return np.zeros(n)
    p = (lam - np.diag(gram)) * vecs[:, -1] / math.sqrt(lam)
    mid = float(np.median(p))
    mad = 1.4826 * float(np.median(np.abs(p - mid)))
    if not mad > 0:
        return np.zeros(n)
    z: Floats = (p - mid) / mad
    if -z.min() > z.max():
        z = -z
    return z
