"""Update-level attacks (and one data-level helper) for robustness experiments.

Pure numpy functions: a malicious client or the simulation harness calls them on flat float32
updates (model deltas). Nothing here does I/O, and randomness only comes from an explicit
``np.random.Generator``. Each returns new arrays; inputs are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

__all__ = [
    "add_trigger",
    "alie",
    "alie_z",
    "backdoor_data",
    "corner_trigger",
    "flip_labels",
    "gaussian_noise",
    "ipm",
    "min_max",
    "min_sum",
    "rotate_labels",
    "scale_update",
    "split_trigger",
    "square_trigger",
    "sign_flip",
    "sybil_clones",
]

FlatVector = npt.NDArray[np.float32]


def _vector(update: npt.ArrayLike) -> FlatVector:
    v = np.asarray(update, dtype=np.float32)
    if v.ndim != 1:
        raise ValueError(f"expected a flat update, got shape {v.shape}")
    return v


def _honest_stack(honest: npt.ArrayLike) -> npt.NDArray[np.float32]:
    h = np.asarray(honest, dtype=np.float32)
    if h.ndim != 2 or h.shape[0] < 1:
        raise ValueError(f"expected a (clients, params) stack of honest updates, got {h.shape}")
    return h


def sign_flip(update: npt.ArrayLike, *, scale: float = 1.0) -> FlatVector:
    """-scale x update: ascend instead of descend."""
    return (-np.float32(scale) * _vector(update)).astype(np.float32)


def scale_update(update: npt.ArrayLike, *, factor: float) -> FlatVector:
    """factor x update: the boosting of model-replacement attacks (Bagdasaryan et al., 2018)."""
    return (np.float32(factor) * _vector(update)).astype(np.float32)


def gaussian_noise(update: npt.ArrayLike, *, std: float, rng: np.random.Generator,
                   additive: bool = False) -> FlatVector:
    """N(0, std^2) noise in place of the update, or added to it when ``additive``."""
    if not std >= 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    v = _vector(update)
    noise = rng.standard_normal(size=v.shape, dtype=np.float32) * np.float32(std)
    return (v + noise if additive else noise).astype(np.float32)


def sybil_clones(update: npt.ArrayLike, *, k: int, jitter: float,
                 rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """k identities sending one poisoned update, each with its own small Gaussian jitter.

    Returns (k, P). Each clone's jitter has norm about ``jitter`` x ||update||, so jitter=0.05
    makes clones whose pairwise cosine is about 0.997: near-identical, as a cheap flood is.
    """
    if k < 1:
        raise ValueError(f"need k >= 1 clones, got {k}")
    if not jitter >= 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    v = _vector(update)
    sigma = jitter * float(np.linalg.norm(v)) / math.sqrt(v.shape[0])
    noise = rng.standard_normal((k, v.shape[0]), dtype=np.float32) * np.float32(sigma)
    return (v[None, :] + noise).astype(np.float32)


def alie_z(num_clients: int, num_byzantine: int) -> float:
    """Baruch et al.'s z: the largest shift the attackers can hide within the honest spread.

    s = floor(n / 2 + 1) - f clients must be won over; z = Phi^{-1}((n - s) / n).
    """
    n, f = num_clients, num_byzantine
    if not 0 < f < n:
        raise ValueError(f"need 0 < num_byzantine < num_clients, got f={f} n={n}")
    s = math.floor(n / 2 + 1) - f
    q = (n - s) / n
    if not 0 < q < 1:
        # f >= n/2 + 1: the attackers are a majority; any shift works, take a large one.
        return 3.0
    return NormalDist().inv_cdf(q)


def alie(honest: npt.ArrayLike, *, num_clients: int, num_byzantine: int,
         z: float | None = None) -> FlatVector:
    """"A Little Is Enough" (Baruch et al., 2019, https://arxiv.org/abs/1902.06156).

    Every attacker sends mean - z x std of the honest updates it can see (per coordinate),
    a shift small enough to pass median-, trimmed-mean- and Krum-style rules. ``z`` defaults
    to :func:`alie_z` for ``num_clients`` and ``num_byzantine``.
    """
    h = _honest_stack(honest)
    if z is None:
        z = alie_z(num_clients, num_byzantine)
    mean: npt.NDArray[np.float64] = h.mean(axis=0, dtype=np.float64)
    std: npt.NDArray[np.float64] = h.std(axis=0, dtype=np.float64)
    return (mean - z * std).astype(np.float32)


def ipm(honest: npt.ArrayLike, *, eps: float) -> FlatVector:
    """Inner-product manipulation (Xie et al., 2019, https://arxiv.org/abs/1903.03936).

    Every attacker sends -eps x the mean of the honest updates: small eps slips past robust
    rules while turning the aggregate's inner product with the true descent direction negative.
    """
    h = _honest_stack(honest)
    mean: npt.NDArray[np.float64] = h.mean(axis=0, dtype=np.float64)
    return (-eps * mean).astype(np.float32)


def flip_labels(labels: npt.ArrayLike, source: int, target: int) -> npt.NDArray[np.integer]:
    """Targeted label flipping: a copy of ``labels`` with ``source`` labels set to ``target``."""
    y = np.asarray(labels)
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got {y.dtype}")
    out = y.copy()
    out[y == source] = target
    return out


def corner_trigger(num_features: int, *, size: int = 2) -> npt.NDArray[np.intp]:
    """Flat indices of a ``size`` x ``size`` patch in the bottom-right corner of a square image
    stored row by row (``num_features`` = side^2): the pixel-patch trigger of BadNets-style
    backdoors (Gu et al., https://arxiv.org/abs/1708.06733)."""
    side = math.isqrt(num_features)
    if side * side != num_features or not 1 <= size <= side:
        raise ValueError(f"need a square image of side >= {size}, got {num_features} features")
    rows = np.arange(side - size, side)
    return (rows[:, None] * side + rows[None, :]).ravel().astype(np.intp)


def square_trigger(num_features: int, *, size: int, row: int, col: int,
                   checker: bool = False) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]:
    """A ``size`` x ``size`` patch whose top-left pixel is (``row``, ``col``) in a square image
    stored row by row: its flat indices and the values to stamp there (all 1, or a
    checkerboard of 1 and 0 when ``checker``). Placed where honest images have ink (the middle
    of a digit), the trigger shares its input weights with the honest task, unlike a corner
    patch on pixels that are dark in almost every image."""
    side = math.isqrt(num_features)
    if side * side != num_features or size < 1 or not (0 <= row <= side - size
                                                       and 0 <= col <= side - size):
        raise ValueError(f"a {size}x{size} patch at ({row}, {col}) does not fit a square image "
                         f"of {num_features} features")
    r, c = np.meshgrid(np.arange(row, row + size), np.arange(col, col + size), indexing="ij")
    values = (((r + c) % 2 == 0) if checker else np.ones_like(r, dtype=bool)).astype(np.float32)
    return (r * side + c).ravel().astype(np.intp), values.ravel()


def split_trigger(indices: npt.ArrayLike, values: npt.ArrayLike, parts: int
                  ) -> list[tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]]:
    """A trigger cut into ``parts`` contiguous pieces (in index order), one per attacker group:
    the distributed backdoor of Xie et al., "DBA", ICLR 2020 (https://openreview.net/forum?
    id=rkgyS0VFvr). Each group stamps only its piece; the assembled trigger is the attack."""
    idx = np.asarray(indices, dtype=np.intp)
    val = np.asarray(values, dtype=np.float32)
    if idx.shape != val.shape or idx.ndim != 1 or not 1 <= parts <= idx.size:
        raise ValueError(f"cannot split a trigger of {idx.size} pixels into {parts} parts")
    return [(i, v) for i, v in zip(np.array_split(idx, parts), np.array_split(val, parts),
                                   strict=True)]


def rotate_labels(labels: npt.ArrayLike, *, shift: int = 1, classes: int = 10
                  ) -> npt.NDArray[np.integer]:
    """Untargeted label flipping of every class: y -> (y + shift) mod ``classes``."""
    y = np.asarray(labels)
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got {y.dtype}")
    if classes < 2 or shift % classes == 0:
        raise ValueError(f"shift {shift} moves no label among {classes} classes")
    out: npt.NDArray[np.integer] = (y + shift) % classes
    return out.astype(y.dtype)


def add_trigger(x: npt.ArrayLike, trigger: npt.ArrayLike, *,
                value: float | npt.ArrayLike = 1.0) -> npt.NDArray[np.float32]:
    """A copy of the (n, features) inputs ``x`` with the ``trigger`` features set to ``value``
    (one number, or one per trigger index, e.g. a checkerboard)."""
    out = np.array(x, dtype=np.float32, copy=True)
    if out.ndim != 2:
        raise ValueError(f"expected (examples, features) inputs, got shape {out.shape}")
    idx = np.asarray(trigger, dtype=np.intp)
    if idx.size == 0 or idx.min() < 0 or idx.max() >= out.shape[1]:
        raise ValueError(f"trigger indices must lie in [0, {out.shape[1]}), got {idx.size} "
                         "indices out of range or none")
    val = np.asarray(value, dtype=np.float32)
    if val.ndim and val.shape != idx.shape:
        raise ValueError(f"{val.size} trigger values for {idx.size} trigger indices")
    out[:, idx] = val
    return out


def backdoor_data(x: npt.ArrayLike, y: npt.ArrayLike, *, trigger: npt.ArrayLike, target: int,
                  fraction: float, rng: np.random.Generator,
                  value: float | npt.ArrayLike = 1.0
                  ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Trigger backdoor (Gu et al., https://arxiv.org/abs/1708.06733; as a federated client,
    Bagdasaryan et al., https://arxiv.org/abs/1807.00459): a copy of the attacker's own data in
    which a ``fraction`` of the examples carries the trigger and is relabelled ``target``.

    The clean rest keeps the attacker's update close to an honest one (and the main task
    accurate), which is what makes the backdoor hard to spot.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"backdoor fraction must be in (0, 1], got {fraction}")
    xs = np.array(x, dtype=np.float32, copy=True)
    ys = np.array(y, dtype=np.int64, copy=True)
    if xs.ndim != 2 or ys.shape != (xs.shape[0],):
        raise ValueError(f"expected (n, features) inputs and n labels, got {xs.shape}, {ys.shape}")
    k = int(round(fraction * len(ys)))
    chosen = rng.choice(len(ys), size=k, replace=False)
    xs[chosen] = add_trigger(xs[chosen], trigger, value=value)
    ys[chosen] = target
    return xs, ys


def _scaled_search(honest: npt.NDArray[np.float32], direction: npt.NDArray[np.float64],
                   fits: Callable[[npt.NDArray[np.float64]], bool], *, gamma: float,
                   steps: int) -> FlatVector:
    """mean + g x direction for the largest g in [0, gamma] that ``fits`` (bisection)."""
    mean = honest.mean(axis=0, dtype=np.float64)
    lo, hi = 0.0, float(gamma)
    if fits(mean + hi * direction):
        lo = hi
    else:
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            if fits(mean + mid * direction):
                lo = mid
            else:
                hi = mid
    return (mean + lo * direction).astype(np.float32)


def _perturbation(honest: npt.NDArray[np.float32], kind: str) -> npt.NDArray[np.float64]:
    if kind == "std":
        return -honest.std(axis=0, dtype=np.float64)
    mean = honest.mean(axis=0, dtype=np.float64)
    if kind == "unit":
        norm = float(np.linalg.norm(mean))
        return -mean / norm if norm > 0 else np.zeros_like(mean)
    if kind == "sign":
        return -np.sign(mean)
    raise ValueError(f"perturbation must be 'std', 'unit' or 'sign', got {kind!r}")


def _sq_distances(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]
                  ) -> npt.NDArray[np.float64]:
    sq_a, sq_b = np.einsum("ij,ij->i", a, a), np.einsum("ij,ij->i", b, b)
    d: npt.NDArray[np.float64] = np.maximum(sq_a[:, None] + sq_b[None, :] - 2.0 * a @ b.T, 0.0)
    return d


def min_max(honest: npt.ArrayLike, *, perturbation: str = "std", gamma: float = 50.0,
            steps: int = 30) -> FlatVector:
    """Min-Max (Shejwalkar and Houmansadr, NDSS 2021, https://www.ndss-symposium.org/
    ndss-paper/manipulating-the-byzantine-optimizing-model-poisoning-attacks-and-defenses-for-
    federated-learning/): mean + g x p, with g as large as possible while the malicious
    update's largest distance to an honest update stays within the largest honest-honest
    distance, so distance-based filters cannot tell it from the honest spread.

    ``perturbation`` p: ``std`` (-coordinate std, the paper's best), ``unit`` (-mean / |mean|)
    or ``sign`` (-sign(mean)). Every attacker sends the result.
    """
    h = _honest_stack(honest)
    h64 = h.astype(np.float64)
    bound = float(_sq_distances(h64, h64).max())

    def fits(v: npt.NDArray[np.float64]) -> bool:
        return float(((h64 - v) ** 2).sum(axis=1).max()) <= bound

    return _scaled_search(h, _perturbation(h, perturbation), fits, gamma=gamma, steps=steps)


def min_sum(honest: npt.ArrayLike, *, perturbation: str = "std", gamma: float = 50.0,
            steps: int = 30) -> FlatVector:
    """Min-Sum (Shejwalkar and Houmansadr, NDSS 2021): like :func:`min_max`, but the malicious
    update's *sum* of squared distances to the honest updates must stay within the largest such
    sum of any honest update, which also hides it from Krum-style scores."""
    h = _honest_stack(honest)
    h64 = h.astype(np.float64)
    bound = float(_sq_distances(h64, h64).sum(axis=1).max())

    def fits(v: npt.NDArray[np.float64]) -> bool:
        return float(((h64 - v) ** 2).sum()) <= bound

    return _scaled_search(h, _perturbation(h, perturbation), fits, gamma=gamma, steps=steps)
