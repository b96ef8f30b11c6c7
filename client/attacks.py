"""Update-level attacks (and one data-level helper) for robustness experiments.

Pure numpy functions: a malicious client or the simulation harness calls them on flat float32
updates (model deltas). Nothing here does I/O, and randomness only comes from an explicit
``np.random.Generator``. Each returns new arrays; inputs are never modified.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

__all__ = [
    "alie",
    "alie_z",
    "flip_labels",
    "gaussian_noise",
    "ipm",
    "scale_update",
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
