"""Filtering rules: decide which updates to keep by their direction, then average the rest.

Norm clipping bounds how far one update can move the model, but a backdoor does not need to be
large: an attacker that trains on its own data with a trigger sends an update of ordinary norm
whose *direction* carries the backdoor. The rules here look at directions, the way FLAME and
DnC do, and drop what does not belong to the honest majority.

* :func:`majority_cluster` is FLAME's clustering step (Nguyen et al., "FLAME: Taming Backdoors
  in Federated Learning", USENIX Security 2022, https://arxiv.org/abs/2101.02281): HDBSCAN with
  ``min_cluster_size = n/2 + 1`` on cosine distances admits the tightest group that holds a
  majority. With that minimum size, HDBSCAN's one selectable cluster is exactly the first
  single-linkage component to reach a majority, which is what we compute (Kruskal on the
  pairwise cosine distances), so no clustering library is needed.
* :func:`dnc_outliers` is Divide-and-Conquer (Shejwalkar and Houmansadr, "Manipulating the
  Byzantine", NDSS 2021): on random coordinate subsets, centre the updates, project them on
  the top singular vector and drop the ``c x f`` largest projections.

Directions come from count sketches (:func:`murmura.aggregation.sybil.sketch_rows`) when the
model is large, so the cost is one O(n P) pass plus O(n^2 dim), never O(n^2 P).
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError, FlatVector, register_aggregator
from murmura.aggregation.directions import (
    cosine_matrix,
    dnc_outliers,
    majority_cluster,
)
from murmura.aggregation.robust import RobustAggregator
from murmura.aggregation.robust_stats import (
    Stack,
    cap_weights,
    check_weight_cap,
    clip_scales,
    weighted_sum,
)
from murmura.aggregation.sybil_scores import sketch_rows

__all__ = ["DivideAndConquer", "Flame"]

logger = logging.getLogger(__name__)

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]


_WORD = (1 << 64) - 1


def rng_state(rng: np.random.Generator) -> npt.NDArray[np.uint64]:
    """A PCG64 generator's whole state as six uint64 words (a rule's ``state_dict`` holds
    arrays only): a restarted server then draws the numbers the old one would have drawn."""
    st = rng.bit_generator.state
    if st.get("bit_generator") != "PCG64":
        raise AggregationError(f"cannot save a {st.get('bit_generator')} generator")
    s, inc = int(st["state"]["state"]), int(st["state"]["inc"])
    return np.array([s >> 64, s & _WORD, inc >> 64, inc & _WORD, int(st["has_uint32"]),
                     int(st["uinteger"])], dtype=np.uint64)


def set_rng_state(rng: np.random.Generator, words: npt.NDArray[np.uint64]) -> None:
    """Restore what :func:`rng_state` saved (refusing anything else)."""
    w = np.asarray(words)
    if w.shape != (6,) or w.dtype != np.uint64 or int(w[4]) not in (0, 1):
        raise AggregationError("a saved generator state is six uint64 words")
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": (int(w[0]) << 64) | int(w[1]), "inc": (int(w[2]) << 64) | int(w[3])},
        "has_uint32": int(w[4]), "uinteger": int(w[5])}


class _SeededState:
    """``state_dict`` for rules whose only state is their random generator."""

    _rng: np.random.Generator
    name: ClassVar[str]  # each rule's class attribute, as on Aggregator

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"rng": rng_state(self._rng)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if set(state) != {"rng"}:
            raise AggregationError(f"rule {self.name!r} keeps its generator ('rng') only, got "
                                   f"{sorted(state)}")
        set_rng_state(self._rng, state["rng"])


class Flame(_SeededState, RobustAggregator):
    """FLAME (Nguyen et al., USENIX Security 2022, https://arxiv.org/abs/2101.02281):
    majority cluster on cosine distances, clipping to the median norm, optional noise.

    1. :func:`majority_cluster` on 1 - cosine admits the tightest majority group; the rest
       (backdoors whose direction differs from the honest majority, and honest outliers) is
       dropped.
    2. Each admitted update is clipped to the median norm of all updates.
    3. The weighted mean of the admitted, clipped updates, plus N(0, (``noise`` x bound)^2)
       per coordinate. FLAME's noise removes what is left of a backdoor but costs accuracy;
       it is off by default (``noise=0``) and seeded when on.

    Assumes fewer than half of the updates are malicious and that malicious directions are
    farther from the honest majority than honest clients are from each other. Under strongly
    non-IID data it drops honest minorities too, which costs accuracy. ``dim`` > 0 measures
    cosines on count sketches of that size (one O(nP) pass; error ~ 1/sqrt(dim)); ``dim=0``
    uses the exact O(n^2 P) Gram matrix. Stateless apart from the noise generator, which
    ``state_dict`` carries.
    """

    name = "flame"

    def __init__(self, size: int, *, dim: int = 1024, noise: float = 0.0, seed: int = 0,
                 weight_cap: float | None = 4.0) -> None:
        super().__init__(size)
        check_weight_cap(weight_cap)
        if int(dim) != dim or (dim != 0 and dim < 16):
            raise AggregationError(f"flame dim must be 0 (exact) or an integer >= 16, got {dim}")
        if not (math.isfinite(noise) and noise >= 0):
            raise AggregationError(f"flame noise must be >= 0, got {noise}")
        self.dim, self.noise, self.seed = int(dim), float(noise), seed
        self.weight_cap = weight_cap
        self._rng = np.random.default_rng(seed)
        self.last_admitted: Mask = np.zeros(0, dtype=bool)

    def directions(self, x: Stack) -> Floats:
        """Rows whose cosines approximate the updates' (sketches) or equal them (dim=0)."""
        if self.dim == 0 or self.dim >= x.shape[1]:
            return np.asarray(x, dtype=np.float64)
        return sketch_rows(x, dim=self.dim, seed=self.seed)

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        admitted = majority_cluster(1.0 - cosine_matrix(self.directions(x)))
        self.last_admitted = admitted
        bound = float(np.median(norms))
        w = np.zeros(len(weights))
        w[admitted] = cap_weights(weights[admitted], ratio=self.weight_cap)
        out = weighted_sum(x, w * clip_scales(norms, bound) / w.sum())
        if self.noise > 0:
            out = out + (self._rng.standard_normal(self.size, dtype=np.float32)
                         * np.float32(self.noise * bound))
        return out


class DivideAndConquer(_SeededState, RobustAggregator):
    """Divide-and-Conquer (Shejwalkar and Houmansadr, NDSS 2021,
    https://www.ndss-symposium.org/ndss-paper/manipulating-the-byzantine-optimizing-model-
    poisoning-attacks-and-defenses-for-federated-learning/): drop the ``c x f`` updates that
    stick out most along the top principal direction, over random coordinate subsets.

    Assumes at most ``f`` malicious updates (``f`` defaults to 20% of the buffer) and that
    their harm lies along one dominant direction, which is what Min-Max / Min-Sum / ALIE /
    IPM and label flipping produce. Always drops ``c x f`` updates, honest ones included when
    there is no attack. Cost: O(n x subsample) per iteration plus one pass for the mean.
    """

    name = "dnc"

    def __init__(self, size: int, *, f: int | None = None, fraction: float = 0.2,
                 c: float = 1.0, iterations: int = 5, subsample: int = 10_000, seed: int = 0,
                 weight_cap: float | None = 4.0) -> None:
        super().__init__(size)
        check_weight_cap(weight_cap)
        if f is not None and (int(f) != f or f < 0):
            raise AggregationError(f"dnc f must be an integer >= 0, got {f}")
        if not 0 <= fraction < 0.5:
            raise AggregationError(f"dnc fraction must be in [0, 0.5), got {fraction}")
        if not (math.isfinite(c) and c > 0):
            raise AggregationError(f"dnc c must be positive, got {c}")
        if int(iterations) != iterations or iterations < 1:
            raise AggregationError(f"dnc iterations must be >= 1, got {iterations}")
        if int(subsample) != subsample or subsample < 1:
            raise AggregationError(f"dnc subsample must be >= 1, got {subsample}")
        self.f, self.fraction, self.c = f, float(fraction), float(c)
        self.iterations, self.subsample = int(iterations), int(subsample)
        self.weight_cap = weight_cap
        self._rng = np.random.default_rng(seed)
        self.last_kept: Mask = np.zeros(0, dtype=bool)

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        n = x.shape[0]
        f = int(math.floor(self.fraction * n)) if self.f is None else self.f
        keep = dnc_outliers(x, f=f, c=self.c, iterations=self.iterations,
                            subsample=self.subsample, rng=self._rng)
        self.last_kept = keep
        w = np.zeros(n)
        w[keep] = cap_weights(weights[keep], ratio=self.weight_cap)
        return weighted_sum(x, w / w.sum())


register_aggregator("flame", Flame)
register_aggregator("dnc", DivideAndConquer)
