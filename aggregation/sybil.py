"""Sybil-resistant aggregation rules: ``sybil``, ``sybil-cclip`` and ``default`` (the
recommended rule).

Each weights a buffer's updates with :class:`~murmura.aggregation.sybil_scores.SybilWeighting`
(an attacker's clone identities get weight 0; the idea, its state and its cost are described
in :mod:`murmura.aggregation.sybil_scores`), then combines them: a capped weighted mean
(:class:`SybilMean`), norm and centred clipping (:class:`SybilCenteredClip`), or a norm
screen and a per-coordinate Huber mean (:class:`RobustDefault`). The scorer and its
sketches are re-exported here, where callers import them.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError, FlatVector, register_aggregator
from murmura.aggregation.collusion import CollusionScreen
from murmura.aggregation.columns import ColumnRunner, copy_rows
from murmura.aggregation.directions import cosine_matrix, linkage_group, unit_rows
from murmura.aggregation.robust import RobustAggregator
from murmura.aggregation.robust_stats import (
    Floats,
    Stack,
    cap_weights,
    centered_clip,
    check_weight_cap,
    clip_scales,
    huber_mean,
    weighted_median,
    weighted_sum,
)
from murmura.aggregation.sybil_scores import SybilWeighting, similarity_weights, sketch_rows

__all__ = [
    "RobustDefault",
    "SybilCenteredClip",
    "SybilMean",
    "SybilWeighting",
    "sketch_rows",
    "similarity_weights",
]


class SybilMean(RobustAggregator):
    """Weighted mean with FoolsGold-style Sybil weights: sum_i w_i s_i f_i u_i / sum_i w_i s_i.

    Example counts w_i are capped at ``weight_cap`` x the median count of non-clones.

    Fung et al., https://arxiv.org/abs/1808.04866. Tolerates any number of clone identities of
    one attacker (see :class:`SybilWeighting`); gives no protection against Byzantine updates
    that are dissimilar to each other, so prefer ``default``, which adds clipping. Histories
    outlive ``reset()``; a buffer's updates enter them on its first ``result()``. Updates
    without a client id get a one-off history, forgotten at ``reset()``. If every update is
    judged a clone, the aggregate is zero (no step).
    """

    name = "sybil"

    def __init__(self, size: int, *, dim: int = 512, max_clients: int = 10_000, seed: int = 0,
                 low: float = 0.95, high: float = 0.99, recent: int = 3,
                 weight_cap: float | None = 4.0) -> None:
        super().__init__(size)
        check_weight_cap(weight_cap)
        self.weight_cap = weight_cap
        self.scorer = SybilWeighting(size, dim=dim, max_clients=max_clients, seed=seed,
                                     low=low, high=high, recent=recent)
        self.last_weights: Floats = np.zeros(0)
        #: per row of the last buffer: the cosine with its client's history before it (NaN:
        #: no history), from :meth:`SybilWeighting.consistency`
        self.last_consistency: Floats = np.zeros(0)
        self.last_ids: list[str] = []
        self._sketches: Floats = np.zeros((0, dim))
        self._committed = False
        self._anonymous: set[str] = set()

    def sybil_weights(self, x: Stack, factors: Floats, ids: list[str]) -> Floats:
        """Sybil weight per row; the first call per buffer adds the rows to the histories."""
        keys = [cid or f"\x00anonymous-{i}" for i, cid in enumerate(ids)]
        if len(set(keys)) > self.scorer.max_clients:
            raise AggregationError(
                f"buffer holds {len(set(keys))} clients but max_clients is "
                f"{self.scorer.max_clients}; raise max_clients"
            )
        if not self._committed:
            # Rows arrive scaled by their factor; the history needs only the direction.
            sketches = self.scorer.sketch(x, self.columns)
            self._sketches = sketches
            self.last_consistency = self.scorer.consistency(keys, sketches)
            self.scorer.tick()
            for key, sketch, factor in zip(keys, sketches, factors, strict=True):
                self.scorer.observe(key, sketch, factor=float(factor))
            self._anonymous.update(k for k, cid in zip(keys, ids, strict=True) if not cid)
            self._committed = True
        self.last_weights = self.scorer.weights(keys)
        self.last_ids = list(ids)
        return self.last_weights

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        s = self.sybil_weights(x, factors, ids)
        w = self._capped(weights, s) * s
        if not w.sum() > 0:
            return np.zeros(self.size, dtype=np.float32)
        return weighted_sum(x, w / w.sum(), runner=self.columns)

    def _capped(self, weights: Floats, s: Floats) -> Floats:
        # The cap is relative to the median weight of non-clones: clones claiming tiny (or
        # huge) counts cannot move it.
        keep = s > 0
        if not keep.any():
            return weights
        capped = cap_weights(weights[keep], ratio=self.weight_cap)
        out = weights.copy()
        out[keep] = capped
        return out

    def reset(self) -> None:
        super().reset()
        self._committed = False
        for key in self._anonymous:
            self.scorer.forget(key)
        self._anonymous.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The clients' histories (anonymous one-off histories are not kept)."""
        return {f"scorer.{k}": v for k, v in self.scorer.state_dict().items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.scorer.load_state_dict({k[len("scorer."):]: v for k, v in state.items()
                                     if k.startswith("scorer.")})


class SybilCenteredClip(SybilMean):
    """Sybil weights, then adaptive norm clipping, then centred clipping (the default until the
    backdoor benchmark showed it lets trigger backdoors of distinct clients through).

    1. Sybil weights s_i (:class:`SybilWeighting`) remove clone floods of any size, including
       colluding attacks that send one shared vector (ALIE, IPM).
    2. Each update is clipped to ``clip_multiplier`` x the median norm of the non-clone updates,
       which bounds boosted updates.
    3. Centred clipping (Karimireddy et al., https://arxiv.org/abs/2012.10333) around the last
       aggregate, with weights w_i s_i (w_i capped at ``weight_cap`` x the median) and radius
       ``tau_scale`` x the median distance (votes s_i), bounds what the remaining (non-clone)
       Byzantine minority can do per round.

    Tolerates clone floods of any share of identities plus a minority (< 1/2 of the non-clone
    weight) of dissimilar Byzantine clients whose harm is in their norm or their overall
    direction. It does not stop a backdoor: a trigger backdoor of ordinary norm passes every
    clipping stage, and honest updates never pull the trigger's weights back (benchmark in
    docs/robustness.md). State (histories and centre) outlives ``reset()``. Cost: the sketch
    pass, then 2 + 2 x ``iterations`` passes over the buffer.
    """

    name = "sybil-cclip"

    def __init__(self, size: int, *, dim: int = 512, max_clients: int = 10_000, seed: int = 0,
                 low: float = 0.95, high: float = 0.99, recent: int = 3,
                 weight_cap: float | None = 4.0, clip_multiplier: float = 2.0,
                 tau_scale: float = 1.0, iterations: int = 3) -> None:
        super().__init__(size, dim=dim, max_clients=max_clients, seed=seed, low=low, high=high,
                         recent=recent, weight_cap=weight_cap)
        if not (math.isfinite(clip_multiplier) and clip_multiplier > 0):
            raise AggregationError(f"clip_multiplier must be positive, got {clip_multiplier}")
        if not (math.isfinite(tau_scale) and tau_scale > 0):
            raise AggregationError(f"tau_scale must be positive, got {tau_scale}")
        if int(iterations) != iterations or iterations < 1:
            raise AggregationError(f"iterations must be an integer >= 1, got {iterations}")
        self.clip_multiplier = float(clip_multiplier)
        self.tau_scale = float(tau_scale)
        self.iterations = int(iterations)
        self.centre = np.zeros(size, dtype=np.float32)
        self._start = self.centre

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        first = not self._committed
        s = self.sybil_weights(x, factors, ids)
        w = self._capped(weights, s) * s
        if not w.sum() > 0:
            return np.zeros(self.size, dtype=np.float32)
        bound = self.clip_multiplier * weighted_median(norms, s)
        if first:
            self._start = self.centre
        out, _ = centered_clip(x, w, centre=self._start, tau=None, tau_scale=self.tau_scale,
                               iterations=self.iterations, votes=s,
                               scales=clip_scales(norms, bound), norms=norms)
        if first:
            self.centre = out
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """The histories and the centre (the last aggregate)."""
        return {**super().state_dict(), "centre": self.centre.copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        centre = np.asarray(state.get("centre", np.zeros(0)), dtype=np.float32)
        if centre.shape != (self.size,):
            raise AggregationError(f"centre has shape {centre.shape}, expected ({self.size},)")
        self.centre = self._start = centre.copy()


#: The direction stage judges no buffer with fewer reference rows than this (a gossip peer's
#: handful of neighbours, a small buffer without history): a 75% group of 5 rows drops one
#: of them whatever it is, and measured in gossip that cost more than it screened.
MIN_DIRECTION_ROWS = 8


class RobustDefault(SybilMean):
    """The recommended rule: Sybil weights, a norm screen, then a per-coordinate Huber mean.

    1. Sybil weights s_i (:class:`SybilWeighting`: histories *and* last updates) find clone
       floods of any size, colluding attacks that send one shared vector (ALIE, IPM, Min-Max,
       Min-Sum) and identities that build a distinct history and then switch to one shared
       vector. Updates with s_i <= 1/2 get no vote.
    1b. Two more weights multiply s_i (docs/robustness.md, "Defences v3"): the collusion
       screen's (:class:`CollusionScreen`: clients whose residual histories share a
       direction), and *consistency*: the cosine of the update with its own client's history
       (:meth:`SybilWeighting.consistency`) against the buffer's median: 1 while it falls
       short of the median by at most ``consistency_low``, 0 from ``consistency_high``. An
       honest client's updates keep pointing where its data pulls; a trust-building
       identity that turns its updates around (or re-crafts them per batch) loses its vote
       from its first such update, in sync and in async buffers alike. Anonymous rows and
       first updates have no history and keep 1.
    2. Updates longer than ``norm_cap`` x the median norm of the rest get no vote either: a
       minority of huge updates (boosted, or sign flipped and scaled) all sit at one end of
       every coordinate's order and would shift the median and widen the clipping range
       toward them. An honest update is rarely several times the median length.
    2b. The voters whose update *direction* lies outside the tightest single-linkage group of
       ``1 - direction_trim`` of the rows get no vote (:meth:`direction_group`, cosine
       distance on the Sybil stage's count sketches; FLAME's clustering step, Nguyen et al.,
       USENIX Security 2022, https://arxiv.org/abs/2101.02281, with a group of 75% instead
       of a bare majority). Why: a backdoor cut between attackers (DBA, Xie et al., ICLR
       2020) or placed on pixels honest data uses keeps every coordinate inside the honest
       spread, so stage 3 only bounds its pull, round after round; the attackers' shared
       objective shows in the direction of the whole update. The group is found on the
       voters (a seeded subset of ``max_rows`` of them when there are more, every voter then
       admitted when its nearest group member lies within the group's own linkage height)
       plus, in a buffer smaller than ``max_rows``, the history's rows of other clients
       (stage 5's): a 10-row buffer alone cannot tell a 30% minority from the rest. At most
       ``direction_trim`` of a buffer's voters leave (the farthest first), none when the
       reference has fewer than :data:`MIN_DIRECTION_ROWS` rows, and a zero update (no
       direction) always votes, except that a voter outside the group in most of its recent
       buffers (its count of them, each older one weighing ``strike_decay`` less, reaches
       ``strike_limit``: the last two of them at the defaults) leaves even past that share:
       a DBA group that fills a third of a small buffer is outside it buffer after buffer,
       an honest outlier now and then (FLDetector's point, that consistency over time tells
       them apart; ``strike_limit=None`` turns this off). Cost: honest rows far from the
       others lose their vote too; measured on the robustness benchmark in
       docs/robustness.md. ``direction_trim=0`` turns the stage off (a gossip peer's default
       does: gossip/mixing.py).
    3. Per coordinate, the voters' values are clipped to median +- ``huber_c`` x sigma
       (sigma = 1.4826 x the median absolute deviation) and averaged with their example
       counts, capped at ``weight_cap`` x the median count (:func:`~murmura.aggregation.robust.
       huber_mean`: one step of Huber's M-estimator from the median; Huber, "Robust Estimation
       of a Location Parameter", Ann. Math. Statist. 1964,
       https://doi.org/10.1214/aoms/1177703732). Where honest values spread normally it is
       close to FedAvg's weighted mean, so it keeps most of the mean's variance reduction,
       which the plain coordinate median (Yin et al., https://arxiv.org/abs/1803.01498, this
       rule's last stage before) gave up. A trigger backdoor lives in weights that honest
       updates barely move (the trigger's pixels are rarely lit in honest data): there the
       honest spread is ~0, so the attackers' values are clipped to ~the honest median, and
       each voter's pull on any coordinate is bounded by its capped weight share times
       ``huber_c`` sigma, round after round. ``huber_c=0`` is the weighted median-clamp,
       i.e. the coordinate median of the statistic's rows.
    4. The median and the MAD come from a seeded random subset of ``max_rows`` voters when
       there are more (a 20% minority stays far below half of such a subset); the clipped
       mean covers every voter. Cost: one sort of at most ``max_rows`` rows per coordinate
       and one clamp-and-sum pass over the voters.
    5. A buffer with fewer than ``max_rows`` voters (asynchronous buffers of 10, say) also
       takes into its median and MAD the newest earlier update of up to ``history`` other
       clients that voted before (one row per identity, so a fast device counts once). A
       small buffer is a small sample: an attacker minority of 20% of the identities fills
       3 or 4 of 10 places in many buffers, enough to drag a 10-row median, while it stays
       near 20% of the 40-odd rows with history. Measured on the backdoor benchmark (async,
       buffer 10, 20% attackers), the worst seed's backdoor success fell from 12.5% to 4%.
       Earlier rows were computed on older versions, so they only steady the statistic;
       they are never averaged again. In a synchronous round every client votes with its
       current row; only a client screened out this round (by its norm or as a clone) can
       stand in with its earlier row.

    6. ``head`` / ``head_c`` (opt-in): the last ``head`` values (a classifier's output layer:
       its weight matrix and bias, last in the flat vector) are clipped with ``head_c``
       instead. Why: under label skew the output layer is where honest clients differ most
       (each pulls its own classes' rows), so clipping it at the body's constant biases the
       mean away from FedAvg; a trigger's pull lives in the input layer, where the trigger's
       pixels are rarely lit in honest data. Measured on the robustness benchmark's digits
       MLP in docs/robustness.md. A server, which knows the model's layers, fills ``head``
       from its spec and, unless told otherwise, runs this rule with ``huber_c`` 1.0 and
       ``head_c`` 2.5 (``server/policy.py::layered_default``); on its own the rule keeps one
       constant.

    Assumes: fewer than half of the non-clone updates in a buffer are malicious (per
    coordinate), and a Sybil attacker's identities send near-identical updates. An attacker
    minority still moves each coordinate by up to its weight share x ``huber_c`` sigma per
    round, so ``huber_c`` trades accuracy without attack (larger) against backdoor
    resistance (smaller); the measured trade-off is in docs/robustness.md. State: the Sybil
    histories and last updates (plain numpy arrays and an ordered dict of slots), which
    outlive ``reset()``. The ``history`` rows (``history`` x P x 4 bytes of memory) also
    outlive ``reset()`` but are left out of :meth:`state_dict`: a checkpoint per version
    that held them would be ``history`` times the model's size. A rule rebuilt from its
    state therefore starts with no history; its statistics match the original's again once
    ``history`` clients have voted (rows of clients seen after the restart replace the
    rest), and until then a small buffer is screened as with ``history=0``.
    """

    name = "default"

    def __init__(self, size: int, *, dim: int = 512, max_clients: int = 10_000, seed: int = 0,
                 low: float = 0.95, high: float = 0.99, recent: int = 3,
                 norm_cap: float | None = 4.0, max_rows: int = 64, huber_c: float = 1.345,
                 weight_cap: float | None = 4.0, history: int = 32, head: int = 0,
                 head_c: float | None = None, screen: bool = True, screen_low: float = 2.0,
                 screen_high: float = 2.5, screen_window: int = 256,
                 screen_short_low: float = 3.0, screen_short_high: float = 4.0,
                 screen_pair_low: float | None = 0.55,
                 screen_pair_high: float | None = 0.65, screen_centre_extra: int = 32,
                 screen_min_clients: int = 16, strike_limit: float | None = 1.5,
                 strike_decay: float = 0.5,
                 direction_trim: float = 0.25, consistency_low: float | None = 0.5,
                 consistency_high: float | None = 0.75) -> None:
        super().__init__(size, dim=dim, max_clients=max_clients, seed=seed, low=low, high=high,
                         recent=recent, weight_cap=weight_cap)
        if (consistency_low is None) != (consistency_high is None) or (
                consistency_low is not None and consistency_high is not None
                and not 0.0 <= consistency_low < consistency_high <= 2.0):
            raise AggregationError(
                f"consistency_low and consistency_high must both be None (no consistency "
                f"weight) or gaps between cosines with 0 <= low < high <= 2, got "
                f"{consistency_low} and {consistency_high}")
        self.consistency = (None if consistency_low is None or consistency_high is None
                            else (float(consistency_low), float(consistency_high)))
        self.screen = (CollusionScreen(dim, max_clients=max_clients, window=screen_window,
                                       low=screen_low, high=screen_high,
                                       short_low=screen_short_low,
                                       short_high=screen_short_high, pair_low=screen_pair_low,
                                       pair_high=screen_pair_high,
                                       centre_extra=screen_centre_extra,
                                       min_clients=screen_min_clients) if screen else None)
        self.last_effective: Floats = np.zeros(0)
        if int(max_rows) != max_rows or max_rows < 1:
            raise AggregationError(f"max_rows must be an integer >= 1, got {max_rows}")
        if int(history) != history or history < 0:
            raise AggregationError(f"history must be an integer >= 0, got {history}")
        if norm_cap is not None and not (math.isfinite(norm_cap) and norm_cap >= 1):
            raise AggregationError(f"norm_cap must be None or a ratio >= 1, got {norm_cap}")
        if not (math.isfinite(huber_c) and huber_c >= 0):
            raise AggregationError(f"huber_c must be a finite number >= 0, got {huber_c}")
        if int(head) != head or not 0 <= head <= size:
            raise AggregationError(f"head must be a number of trailing values in 0..{size}, "
                                   f"got {head}")
        if head_c is not None and not (math.isfinite(head_c) and head_c >= 0):
            raise AggregationError(f"head_c must be None or a finite number >= 0, got {head_c}")
        self.head = int(head)
        self.head_c = None if head_c is None else float(head_c)
        if not 0 <= direction_trim < 0.5:
            raise AggregationError(f"direction_trim must lie in [0, 0.5), got {direction_trim}")
        self.direction_trim = float(direction_trim)
        if strike_limit is not None and not (math.isfinite(strike_limit) and strike_limit > 0):
            raise AggregationError(f"strike_limit must be None or a positive number, got "
                                   f"{strike_limit}")
        if not 0 <= strike_decay < 1:
            raise AggregationError(f"strike_decay must lie in [0, 1), got {strike_decay}")
        self.strike_limit = None if strike_limit is None else float(strike_limit)
        self.strike_decay = float(strike_decay)
        # per client, least recently judged first: its buffers outside the direction group,
        # each older one counting strike_decay times less (at most max_clients clients)
        self._strikes: OrderedDict[str, float] = OrderedDict()
        self.max_rows = int(max_rows)
        self.norm_cap = None if norm_cap is None else float(norm_cap)
        self.huber_c = float(huber_c)
        self.seed = seed
        self.last_voters: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)
        self.last_stat_rows: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)
        self.last_history: list[str] = []  # clients whose earlier rows joined the statistic
        self.history = int(history)
        # np.empty reserves address space only: pages are touched as clients fill the rows.
        self._past = np.empty((self.history, size), dtype=np.float32)
        self._past_slots: OrderedDict[str, int] = OrderedDict()  # client -> row, oldest first
        self._past_sketch = np.zeros((self.history, dim))  # each history row's direction
        # This buffer's voters: (client, row number, sketch); the rows stay put until reset().
        self._pending: list[tuple[str, int, Floats]] = []
        self._pending_rows: Stack | None = None  # the array _pending's row numbers index
        self._noted = False

    def voters(self, s: Floats, norms: Floats) -> npt.NDArray[np.intp]:
        """Rows that vote: non-clones of ordinary length."""
        rows = np.flatnonzero(s > 0.5)
        if rows.size and self.norm_cap is not None:
            bound = self.norm_cap * float(np.median(norms[rows]))
            rows = rows[norms[rows] <= bound]
        return rows

    def direction_group(self, rows: npt.NDArray[np.intp], ids: list[str], first: bool = False
                        ) -> npt.NDArray[np.intp]:
        """Stage 2b: the voters whose direction lies within the tightest single-linkage group
        of ``1 - direction_trim`` of the reference rows (all voters, or ``max_rows`` of them,
        plus the history's rows when the buffer is small), on the rows' count sketches."""
        if self.direction_trim == 0:
            return rows
        sketches = self._sketches[rows]
        pointed = np.linalg.norm(sketches, axis=1) > 0  # a zero update has no direction
        if pointed.sum() < 3:
            return rows
        ref = self._sketches[self.stat_rows(rows[pointed])]
        if ref.shape[0] < self.max_rows:  # a small buffer: add the history's rows
            others = self._others({ids[r] for r in rows}, self.max_rows - ref.shape[0])
            if others:
                ref = np.vstack([ref, self._past_sketch[[self._past_slots[c] for c in others]]])
        if ref.shape[0] < MIN_DIRECTION_ROWS:  # too few rows to tell a group from noise
            return rows
        size = math.ceil((1.0 - self.direction_trim) * ref.shape[0])
        group, height = linkage_group(1.0 - cosine_matrix(ref), min_size=size)
        # a voter belongs if its nearest group member is within the group's own linkage
        # height (members are their own nearest member, at distance 0)
        nearest = 1.0 - (unit_rows(sketches) @ unit_rows(ref[group]).T).max(axis=1)
        out = pointed & (nearest > height + 1e-9)
        struck = self._strike(rows, ids, out, first)
        # At most direction_trim of this buffer's voters leave, the farthest first: with
        # history rows in the reference, a buffer's few current rows (a Sybil flood fills the
        # rest) would otherwise lose more than the stage's share to a group of older rows.
        # Voters that were outside in most of their recent buffers (struck) leave anyway.
        cap = int(self.direction_trim * rows.size)
        if out.sum() > cap:
            farthest = np.argsort(-np.where(out, nearest, -np.inf), kind="stable")[:cap]
            out = struck.copy()
            out[farthest] = True
        return rows[~out]

    def _strike(self, rows: npt.NDArray[np.intp], ids: list[str], out: npt.NDArray[np.bool_],
                first: bool) -> npt.NDArray[np.bool_]:
        """Which voters outside the group are *struck*: their decayed count of buffers spent
        outside it (this one included; counted on the buffer's first call) reaches
        ``strike_limit``. Anonymous rows are never struck."""
        struck = np.zeros_like(out)
        if self.strike_limit is None:
            return struck
        for i, r in enumerate(rows):
            cid = ids[r]
            if not cid:
                continue
            if first:
                self._strikes[cid] = self.strike_decay * self._strikes.pop(cid, 0.0) + float(
                    out[i])
                while len(self._strikes) > self.scorer.max_clients:
                    self._strikes.popitem(last=False)
            struck[i] = bool(out[i]) and self._strikes.get(cid, 0.0) >= self.strike_limit
        return struck

    def stat_rows(self, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """The voters whose median and MAD set the clipping range: all of them, or a subset of
        ``max_rows`` seeded by the buffer count (so ``result()`` is repeatable)."""
        if rows.size <= self.max_rows:
            return rows
        rng = np.random.default_rng([self.seed, self.scorer.clock])
        return np.sort(rng.choice(rows, size=self.max_rows, replace=False))

    def screen_weights(self, s: Floats, factors: Floats, ids: list[str], first: bool) -> Floats:
        """The collusion screen's weight per row times the consistency weight (stage 1b; all
        1 when both are off); the first call per buffer adds the non-clone rows' residuals
        to the screen's histories."""
        t = self.consistency_weights(ids)
        if self.screen is None:
            return t
        keys = [cid or f"\x00anonymous-{i}" for i, cid in enumerate(ids)]
        if first:
            self.screen.observe(keys, self._sketches, factors, centre_rows=s > 0.5)
        return self.screen.weights(keys) * t

    def consistency_weights(self, ids: list[str]) -> Floats:
        """Per row, by how far its update's agreement with its own client's history falls
        below the buffer's median agreement (the *gap*): 1 up to a gap of
        ``consistency_low``, 0 from ``consistency_high``, linear in between; 1 for anonymous
        rows, clients without a history, and buffers with fewer than 3 rows that have one.
        Relative, not absolute: where every client's updates are mostly noise (near
        convergence, say) all agreements are near 0 and nobody is judged."""
        if self.consistency is None or len(self.last_consistency) != len(ids):
            return np.ones(len(ids))
        low, high = self.consistency
        cos = np.where([bool(cid) for cid in ids], self.last_consistency, np.nan)
        known = cos[~np.isnan(cos)]
        if known.size < 3:
            return np.ones(len(ids))
        gap = float(np.median(known)) - cos
        with np.errstate(invalid="ignore"):
            w = np.clip((high - gap) / (high - low), 0.0, 1.0)
        return np.where(np.isnan(cos), 1.0, w)

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        first = not self._committed
        s = self.sybil_weights(x, factors, ids)
        t = self.screen_weights(s, factors, ids, first)
        rows = self.direction_group(self.voters(s * t, norms), ids, first)
        # the weight each row votes with in the end: 0 outside the voters (clones, screened,
        # too long, or outside the direction group)
        self.last_effective = np.zeros(len(ids))
        self.last_effective[rows] = (s * t)[rows]
        self.last_voters = rows
        self.last_stat_rows = self.stat_rows(rows)
        if rows.size == 0:
            return np.zeros(self.size, dtype=np.float32)
        w = cap_weights(weights[rows], ratio=self.weight_cap) * t[rows]
        if not w.sum() > 0:  # every voter claimed no examples: one vote each
            w = np.ones(rows.size)
        stat = None if self.last_stat_rows.size == rows.size else self.last_stat_rows
        extra = self._history_rows(x, ids, rows)
        return huber_mean(x, c=self.huber_c, weights=w,
                          rows=None if rows.size == x.shape[0] else rows, stat_rows=stat,
                          extra=None if extra is None else self._past, extra_rows=extra,
                          tail=self.head, tail_c=self.head_c, runner=self.columns)

    def use_columns(self, runner: ColumnRunner) -> None:
        """As :meth:`RobustAggregator.use_columns`; the history rows move too (the Huber
        stage reads them as extra statistic rows)."""
        old = self.columns
        super().use_columns(runner)
        # slots are handed out in order until the history is full
        self._past = self._in_runner(self._past, old, len(self._past_slots))

    def _others(self, here: set[str], room: int) -> list[str]:
        """Up to ``room`` clients with a history row, newest first, none of them in ``here``."""
        return [cid for cid in reversed(self._past_slots) if cid not in here][:max(room, 0)]

    def _history_rows(self, x: Stack, ids: list[str], rows: npt.NDArray[np.intp]
                      ) -> npt.NDArray[np.intp] | None:
        """Rows of the history for this buffer's statistic (newest first, clients not in the
        buffer, up to ``max_rows`` rows in all); notes this buffer's voters for :meth:`reset`."""
        if self.history == 0:
            return None
        here = {ids[r] for r in rows}
        if not self._noted:
            # Newest row per identified client; anonymous rows have no identity to count once.
            latest = {ids[r]: int(r) for r in rows if ids[r]}
            keep = list(latest.items())[-self.history:]
            self._pending = [(cid, r, self._sketches[r]) for cid, r in keep]
            self._pending_rows = x
            self._noted = True
        picked = self._others(here, self.max_rows - self.last_stat_rows.size)
        self.last_history = picked
        if not picked:
            return None
        return np.array([self._past_slots[cid] for cid in picked], dtype=np.intp)

    def reset(self) -> None:
        """Clear the buffer; its voters' rows become the newest history."""
        if self.screen is not None:
            for key in self._anonymous:
                self.screen.forget(key)
        super().reset()
        src, dst = [], []
        for cid, row, sketch in self._pending:
            slot = self._past_slots.pop(cid, None)
            if slot is None:  # a free row while there is one, else the oldest client's
                slot = len(self._past_slots) if len(self._past_slots) < self.history \
                    else self._past_slots.popitem(last=False)[1]
            src.append(row)
            dst.append(slot)
            self._past_sketch[slot] = sketch
            self._past_slots[cid] = slot
        if src:  # the rows are copied by the column runner (in the workers, on a server)
            self.columns.run(copy_rows, {"src": self._pending_rows, "dst": self._past},
                             (np.array(src, dtype=np.intp), np.array(dst, dtype=np.intp)),
                             None, self.size)
        self._pending = []
        self._pending_rows = None
        self._noted = False


    def state_dict(self) -> dict[str, np.ndarray]:
        """The Sybil histories, the direction stage's strikes and, with the screen on, its
        residual histories."""
        out = super().state_dict()
        if self.screen is not None:
            out.update({f"screen.{k}": v for k, v in self.screen.state_dict().items()})
        out["strikes.ids"] = np.array(list(self._strikes), dtype=str)
        out["strikes.count"] = np.array(list(self._strikes.values()), dtype=np.float64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        ids = [str(i) for i in np.asarray(state.get("strikes.ids", np.zeros(0, str))).ravel()]
        counts = np.asarray(state.get("strikes.count", np.zeros(0)), dtype=np.float64).ravel()
        if counts.shape != (len(ids),) or not np.isfinite(counts).all():
            raise AggregationError(f"direction strikes: {len(ids)} ids with counts of shape "
                                   f"{counts.shape} (all finite expected)")
        self._strikes = OrderedDict(zip(ids, counts.tolist(), strict=True))
        if self.screen is not None:
            self.screen.load_state_dict({k[len("screen."):]: v for k, v in state.items()
                                         if k.startswith("screen.")})


register_aggregator("sybil", SybilMean)
register_aggregator("sybil-cclip", SybilCenteredClip)
register_aggregator("default", RobustDefault)
