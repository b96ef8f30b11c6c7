"""Client-level differential privacy for decomposable rules: DP-FedAvg with central noise.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language Models"
(ICLR 2018, https://arxiv.org/abs/1710.06963): each client's update (its model delta) is
clipped to L2 norm ``C``; the server adds Gaussian noise N(0, (z C)^2 I) to the *sum* of the
clipped updates and divides by a denominator fixed before any update is seen (the expected
number of contributions ``m``), so the published mean is a post-processing of a Gaussian
mechanism whose sensitivity to one client is C. ``z`` is the noise multiplier an accountant
composes (server/privacy.py); nothing here computes epsilon.

Adaptive clipping: Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning
with Adaptive Clipping" (NeurIPS 2021, https://arxiv.org/abs/1905.03871). Each contribution
also yields a bit b = [norm <= C]; the server releases the noised, centred count
``sum(b - 1/2) + N(0, sigma_b^2)`` and moves the clip geometrically toward the target
quantile gamma: ``C <- C exp(-eta (b_bar - gamma))``. Releasing the count is a second
Gaussian query on the same cohort (sensitivity 1/2, so noise multiplier 2 sigma_b); the two
together cost as much as one Gaussian query with multiplier ``z`` when the updates get
``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (the paper's Theorem 1 argument), which is what
:func:`delta_noise_multiplier` gives. The accountant therefore still composes ``z``.

Pure: flat float32 vectors in, one vector out; randomness from ``numpy.random.Generator``
seeded by ``(seed, release index)``, so a rerun with the same seed adds the same noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError, Aggregator, FlatVector
from murmura.aggregation.exact_sum import ExactSum

__all__ = [
    "CLIP_MARGIN",
    "AdaptiveClip",
    "DPMean",
    "Release",
    "adaptive_clip_step",
    "clip_to_norm",
    "count_noise_for",
    "delta_noise_multiplier",
    "l2_norm",
]

#: A clipped update is scaled to ``C (1 - CLIP_MARGIN)``: float32 rounding of each value
#: (relative error <= 2**-24) then cannot take its norm past C.
CLIP_MARGIN = 2.0 ** -20
#: Values per block when a norm is accumulated in float64 (bounded scratch memory).
_NORM_BLOCK = 1 << 16
#: The paper's default for the clip count's noise: sigma_b = expected contributions / 20.
COUNT_NOISE_SHARE = 1.0 / 20.0


def l2_norm(update: npt.NDArray[np.floating[Any]]) -> float:
    """The L2 norm of a flat vector, accumulated in float64 block by block (a float32 dot
    over millions of values loses digits the clip bound relies on)."""
    flat = np.asarray(update).reshape(-1)
    total = 0.0
    for start in range(0, flat.size, _NORM_BLOCK):
        block = flat[start:start + _NORM_BLOCK].astype(np.float64)
        total += float(block @ block)
    return math.sqrt(total)


def clip_to_norm(update: FlatVector, clip: float) -> tuple[FlatVector, float]:
    """``(clipped, norm)``: ``update`` scaled to L2 norm at most ``clip`` (direction kept; the
    same array when it is already within), and its norm before clipping."""
    if not (math.isfinite(clip) and clip > 0):
        raise AggregationError(f"clip must be positive and finite, got {clip}")
    norm = l2_norm(update)
    if not math.isfinite(norm):
        raise AggregationError("update holds NaN or inf (or overflows float32); it cannot be "
                               "clipped")
    if norm <= clip:
        return update, norm
    scale = clip / norm * (1.0 - CLIP_MARGIN)
    return (np.asarray(update, dtype=np.float64) * scale).astype(np.float32), norm


def delta_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """The multiplier for the updates' noise when the clip count is released with noise
    ``count_noise`` (sigma_b) and both together must cost ``noise_multiplier`` (z):
    ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021). Without a count release
    (``count_noise`` = inf) it is ``z``; ``z`` = 0 (no noise) stays 0."""
    z = float(noise_multiplier)
    if z == 0.0 or math.isinf(count_noise):
        return z
    if not 2.0 * count_noise > z:
        raise AggregationError(
            f"adaptive clipping: the clip count's noise sigma_b={count_noise:g} must exceed "
            f"half the noise multiplier ({z:g} / 2); raise it or lower the multiplier")
    return (z ** -2 - (2.0 * count_noise) ** -2) ** -0.5


def count_noise_for(expected: int, noise_multiplier: float, given: float = 0.0) -> float:
    """sigma_b: ``given`` when positive, else the paper's expected/20, raised to ``z`` when
    that is smaller (so the updates' multiplier is at most 2/sqrt(3) ~ 1.155 z)."""
    if given > 0:
        return float(given)
    return max(COUNT_NOISE_SHARE * expected, float(noise_multiplier))


def adaptive_clip_step(clip: float, below: float, target: float, lr: float) -> float:
    """One geometric clip update: ``clip * exp(-lr * (below - target))`` where ``below`` is
    the (noised) share of contributions whose norm was within the clip."""
    return float(clip * math.exp(-lr * (below - target)))


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping's settings: the ``target`` quantile gamma in (0, 1), the learning rate
    ``lr`` (eta) and the clip count's noise ``count_noise`` (sigma_b; 0: expected/20, at least
    the noise multiplier)."""

    target: float
    lr: float = 0.2
    count_noise: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.target < 1.0:
            raise AggregationError(f"adaptive clipping's target quantile must lie in (0, 1), "
                                   f"got {self.target}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise AggregationError(f"adaptive clipping's learning rate must be positive, got "
                                   f"{self.lr}")
        if not (math.isfinite(self.count_noise) and self.count_noise >= 0):
            raise AggregationError(f"adaptive clipping's count noise must be >= 0 (0: "
                                   f"automatic), got {self.count_noise}")


@dataclass(frozen=True)
class Release:
    """What one aggregate released: the figures a metrics row reports about it."""

    clip: float                  # C the updates were clipped to
    noise_multiplier: float      # z, what the accountant composes
    delta_multiplier: float      # z_delta, the updates' own multiplier (= z without adaptive)
    noise_std: float             # standard deviation of the noise on the published mean
    expected: int                # m, the denominator
    sampling_rate: float         # q, as the server planned it
    contributions: int           # updates in the sum
    skipped: int                 # second updates of a client in one aggregate, left out
    below_clip: float | None     # adaptive: the noised share within the clip
    next_clip: float             # the clip of the next aggregate


class DPMean(Aggregator):
    """Differentially private mean over clients around a decomposable rule (``fedavg``).

    ``add`` clips each update to ``clip`` and folds it into ``inner`` with weight 1 (uniform
    weights: an example count a client reports is not bounded, and weighting by it would void
    the sensitivity bound) and its staleness ``factor`` (at most 1, so a contribution never
    exceeds the clip). A client contributes at most once per aggregate: a second update with
    the same ``client_id`` (an async client that pushed twice into one buffer) is left out
    and counted in :attr:`Release.skipped`, so one client's sensitivity is ``clip`` however
    often it pushes.

    ``result`` is ``(sum + N(0, (z_delta C)^2 I)) / expected`` with the noise drawn from
    ``default_rng([seed, release, 0])``. Call :meth:`expect` before each aggregate with the
    expected number of contributions ``m`` and the planned sampling rate ``q``; ``m`` is a
    denominator fixed before any update is seen (McMahan et al.'s fixed-denominator
    estimator), never the number that arrived, so the result is a post-processing of the
    noised sum alone. ``reset`` after a ``result`` commits the release: its entry in
    :attr:`ledger` ``(q, z, count)`` rows, the next clip (adaptive), the release counter. So
    calling ``result`` twice gives the same vector.

    Not decomposable: a partial aggregate cannot be clipped per client, so none may enter.
    """

    name: ClassVar[str] = "dp"
    decomposable: ClassVar[bool] = False

    def __init__(self, inner: Aggregator, *, clip: float, noise_multiplier: float, seed: int,
                 adaptive: AdaptiveClip | None = None, expected: int = 1) -> None:
        super().__init__(inner.size)
        if not getattr(inner, "decomposable", False) or not hasattr(inner, "partial"):
            raise AggregationError(
                f"differential privacy clips each update and noises their sum, which needs a "
                f"decomposable rule (fedavg); rule {inner.name!r} needs every update")
        if not (math.isfinite(clip) and clip > 0):
            raise AggregationError(f"clip must be positive and finite, got {clip}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise AggregationError(f"noise multiplier must be >= 0 and finite, got "
                                   f"{noise_multiplier}")
        if not isinstance(seed, int) or seed < 0:
            raise AggregationError(f"seed must be an integer >= 0, got {seed!r}")
        self.inner = inner
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.seed = seed
        self.adaptive = adaptive
        self.releases = 0
        self.last: Release | None = None
        self._ledger: list[tuple[float, float, int]] = []
        self._expected = 1
        self._rate = 1.0
        self.expect(expected, 1.0)
        self._seen: set[str] = set()
        self._below = 0
        self._skipped = 0
        self._pending: Release | None = None
        #: Contributions in a sum the clients noised themselves (0: central noise here).
        self._distributed = 0

    # -- planning -----------------------------------------------------------------------------

    def expect(self, expected: int, sampling_rate: float) -> None:
        """The next aggregate's denominator ``m`` and sampling rate ``q`` (0 < q <= 1)."""
        if isinstance(expected, bool) or not isinstance(expected, int) or expected < 1:
            raise AggregationError(f"expected contributions must be an integer >= 1, got "
                                   f"{expected!r}")
        if not 0.0 < sampling_rate <= 1.0:
            raise AggregationError(f"sampling rate must lie in (0, 1], got {sampling_rate}")
        self._expected, self._rate = expected, float(sampling_rate)

    @property
    def expected(self) -> int:
        return self._expected

    @property
    def sampling_rate(self) -> float:
        return self._rate

    @property
    def ledger(self) -> list[tuple[float, float, int]]:
        """Every aggregate released so far as ``(q, z, count)`` runs, oldest first: what an
        accountant composes."""
        return list(self._ledger)

    # -- the rule -----------------------------------------------------------------------------

    def add(self, update: FlatVector, weight: float, *, factor: float = 1.0,
            client_id: str = "") -> None:
        self._check(update, weight, factor)
        if factor > 1.0:
            raise AggregationError(f"a factor above 1 ({factor}) would let one update exceed "
                                   f"the clip; differential privacy needs factors <= 1")
        if client_id and client_id in self._seen:
            self._skipped += 1
            return
        clipped, norm = clip_to_norm(update, self.clip)
        self.inner.add(clipped, 1.0, factor=factor)
        if client_id:
            self._seen.add(client_id)
        self._below += norm <= self.clip

    def add_noised_sum(self, total: FlatVector, contributions: int) -> None:
        """Take the sum of ``contributions`` updates that the clients clipped to ``clip`` and
        noised themselves (distributed DP under secure aggregation, where no single party
        sees an un-noised sum): it enters as it is, and :meth:`result` adds no noise of its
        own. The clients' shares are sized so that the noise on the sum has std at least
        ``noise_multiplier * clip``, which is what the ledger records."""
        self._check(total, 1.0, 1.0)
        if self.adaptive is not None:
            raise AggregationError("the adaptive clip needs each update's norm; a noised sum "
                                   "has none")
        if isinstance(contributions, bool) or not isinstance(contributions, int) \
                or contributions < 1:
            raise AggregationError(f"contributions must be an integer >= 1, got "
                                   f"{contributions!r}")
        self.inner.add(total, 1.0)
        self._distributed += contributions

    def result(self) -> FlatVector:
        n = self.inner.count
        if n == 0:
            raise AggregationError("no updates to aggregate")
        partial = self.inner.partial()  # type: ignore[attr-defined]
        total = (partial.sum.value() if isinstance(partial.sum, ExactSum)
                 else np.asarray(partial.sum, dtype=np.float64))
        count_noise = math.inf
        if self.adaptive is not None:
            count_noise = count_noise_for(self._expected, self.noise_multiplier,
                                          self.adaptive.count_noise)
        z_delta = delta_noise_multiplier(self.noise_multiplier, count_noise)
        std_sum = z_delta * self.clip
        if std_sum > 0 and not self._distributed:  # distributed: the clients added it
            rng = np.random.default_rng([self.seed, self.releases, 0])
            total = total + rng.standard_normal(self.size) * std_sum
        out = (total / self._expected).astype(np.float32)
        below: float | None = None
        next_clip = self.clip
        if self.adaptive is not None:
            centred = self._below - 0.5 * n  # sum of (b - 1/2): sensitivity 1/2
            rng = np.random.default_rng([self.seed, self.releases, 1])
            noised = centred + float(rng.standard_normal()) * count_noise
            below = noised / self._expected + 0.5
            next_clip = adaptive_clip_step(self.clip, below, self.adaptive.target,
                                           self.adaptive.lr)
        self._pending = Release(
            clip=self.clip, noise_multiplier=self.noise_multiplier, delta_multiplier=z_delta,
            noise_std=std_sum / self._expected, expected=self._expected,
            sampling_rate=self._rate, contributions=self._distributed or n,
            skipped=self._skipped,
            below_clip=below, next_clip=next_clip)
        return out

    def reset(self) -> None:
        release, self._pending = self._pending, None
        if release is not None:  # a result was taken: the release happened
            q, z = release.sampling_rate, release.noise_multiplier
            if self._ledger and self._ledger[-1][:2] == (q, z):
                self._ledger[-1] = (q, z, self._ledger[-1][2] + 1)
            else:
                self._ledger.append((q, z, 1))
            self.clip = release.next_clip
            self.releases += 1
            self.last = release
        self.inner.reset()
        self._seen.clear()
        self._below = 0
        self._skipped = 0
        self._distributed = 0

    @property
    def count(self) -> int:
        return self.inner.count + self._skipped

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        ledger = np.array(self._ledger, dtype=np.float64).reshape(-1, 3)
        state = {"clip": np.array([self.clip]), "releases": np.array([self.releases]),
                 "ledger": ledger}
        state.update({f"inner.{k}": v for k, v in self.inner.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        missing = {"clip", "releases", "ledger"} - state.keys()
        if missing:
            raise AggregationError(f"differential privacy state lacks {sorted(missing)}")
        ledger = np.asarray(state["ledger"], dtype=np.float64).reshape(-1, 3)
        clip = float(np.asarray(state["clip"]).reshape(-1)[0])
        releases = int(np.asarray(state["releases"]).reshape(-1)[0])
        if not (math.isfinite(clip) and clip > 0) or releases != int(ledger[:, 2].sum()):
            raise AggregationError("differential privacy state is inconsistent (clip or "
                                   "release count)")
        self.clip, self.releases = clip, releases
        self._ledger = [(float(q), float(z), int(c)) for q, z, c in ledger]
        self.inner.load_state_dict({k[len("inner."):]: v for k, v in state.items()
                                    if k.startswith("inner.")})
