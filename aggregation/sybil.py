"""Sybil-resistant weighting from update histories, and the recommended default aggregator.

The idea is FoolsGold's (Fung, Yoon and Beschastnikh, "The Limitations of Federated Learning in
Sybil Settings", https://arxiv.org/abs/1808.04866): many identities controlled by one attacker
push the same objective, so their accumulated updates stay far more alike than honest clients'
do, however non-IID the honest data. Such clients are down-weighted, and honest diversity keeps
its weight. What we do differently, and why:

* **Bounded state.** A client's history is a ``dim``-value count sketch (random signs, bucket =
  index mod ``dim``) of its updates, not a model-sized vector. Inner products of sketches
  estimate inner products of updates without bias (error about 1/sqrt(dim) in cosine). The
  signs come from a seeded generator, block by block, so nothing model-sized is stored.
  At most ``max_clients`` histories are kept; the least recently observed is evicted.
* **Unit-length steps, not centred.** Each update enters the history as a unit vector scaled
  by its staleness factor, so no single round (or boosted update) dominates and stale updates
  count less. We do not centre updates on a reference (say the last aggregate or a median):
  that removes the shared descent direction from honest histories, but a clone majority
  captures any such reference, after which clones differ only by their jitter and look
  distinct. The origin cannot be captured; the price is that near-IID honest clients with
  plenty of data have similar histories, so ``low`` and ``high`` sit close to 1.
* **Absolute thresholds.** A client's score is its largest cosine with any other tracked client
  (in the buffer or not, so clones split across asynchronous buffers are still compared). The
  weight is 1 below ``low``, 0 above ``high``, linear in between. FoolsGold instead rescales
  scores relative to the most distinct client, which also zeroes honest clients that merely
  share a label mix; thresholds keep them. On the digits task honest histories stay below
  0.9 while clones with 5% jitter are above 0.997 from their first update.

Cost per buffer: one sketch pass over the updates (O(n P)) and an (n x clients x dim) product;
nothing is O(clients^2 x model).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError, FlatVector, register_aggregator
from murmura.aggregation.robust import RobustAggregator
from murmura.aggregation.robust_stats import (
    Stack,
    cap_weights,
    centered_clip,
    check_weight_cap,
    clip_scales,
    huber_mean,
    weighted_median,
    weighted_sum,
)

__all__ = [
    "RobustDefault",
    "SybilCenteredClip",
    "SybilMean",
    "SybilWeighting",
    "sketch_rows",
    "similarity_weights",
]

Floats = npt.NDArray[np.float64]

# Columns sketched per block: temporaries stay bounded whatever the model size.
_SKETCH_COLUMNS = 8192


def sketch_rows(x: npt.NDArray[np.float32], *, dim: int, seed: int) -> Floats:
    """Count sketch of each row of ``x`` (or of a single vector): shape (n, dim) or (dim,).

    Coordinate j goes to bucket j mod dim with a random sign drawn from ``seed``; the same seed
    always gives the same signs, so sketches of different updates are comparable.
    """
    if dim < 1:
        raise AggregationError(f"sketch dim must be >= 1, got {dim}")
    single = x.ndim == 1
    rows = np.atleast_2d(np.asarray(x, dtype=np.float32))
    n, p = rows.shape
    block = dim * max(8, math.ceil(_SKETCH_COLUMNS / dim / 8) * 8)  # multiple of dim and of 8
    rng = np.random.Generator(np.random.PCG64(seed))
    out = np.zeros((n, dim), dtype=np.float64)
    for a in range(0, p, block):
        length = min(block, p - a)
        bits = np.unpackbits(np.frombuffer(rng.bytes((length + 7) // 8), dtype=np.uint8),
                             count=length)
        # Flip the IEEE sign bit where the random bit is set: exact, and one pass.
        flip = bits.astype(np.uint32) << np.uint32(31)
        chunk = np.ascontiguousarray(rows[:, a:a + length])
        y = (chunk.view(np.uint32) ^ flip).view(np.float32)
        full = (length // dim) * dim
        if full:
            out += y[:, :full].reshape(n, -1, dim).sum(axis=1, dtype=np.float64)
        if full < length:
            out[:, : length - full] += y[:, full:]
    return out[0] if single else out


def similarity_weights(max_similarity: Floats, *, low: float, high: float) -> Floats:
    """1 below ``low``, 0 above ``high``, linear in between."""
    s = np.asarray(max_similarity, dtype=np.float64)
    return np.clip((high - s) / (high - low), 0.0, 1.0)


def _check_thresholds(low: float, high: float) -> None:
    if not (-1.0 <= low < high <= 1.0):
        raise AggregationError(f"need -1 <= low < high <= 1 for similarities, got {low}, {high}")


class SybilWeighting:
    """Stateful Sybil scorer over bounded client histories (see the module docstring).

    Use it alone (e.g. a gossip peer scoring its neighbours): ``sketch`` each update,
    ``observe`` it, then ask ``weights`` for the clients to be combined.
    Assumes the attacker's identities push one shared objective; it tolerates any number of
    such clones (their weight goes to 0 together) but not attackers whose updates differ as much
    as honest ones do, which are left to the robust rules in :mod:`murmura.aggregation.robust`.
    Honest clients with near-identical data look like clones too; raise ``low`` and ``high``
    if that is expected.
    """

    def __init__(self, size: int, *, dim: int = 512, max_clients: int = 10_000, seed: int = 0,
                 low: float = 0.95, high: float = 0.99, recent: int = 3) -> None:
        if size <= 0:
            raise AggregationError(f"model size must be positive, got {size}")
        if int(dim) != dim or dim < 16:
            raise AggregationError(f"sketch dim must be an integer >= 16, got {dim}")
        if int(max_clients) != max_clients or max_clients < 2:
            raise AggregationError(f"max_clients must be an integer >= 2, got {max_clients}")
        _check_thresholds(low, high)
        if int(recent) != recent or recent < 0:
            raise AggregationError(f"recent must be an integer >= 0, got {recent}")
        self.size, self.dim, self.max_clients, self.seed = size, int(dim), int(max_clients), seed
        self.low, self.high, self.recent = float(low), float(high), int(recent)
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently observed first
        self._free: list[int] = []
        self._hist = np.zeros((0, self.dim), dtype=np.float32)
        # The last update of each client (unit sketch) and the clock tick it arrived at: clones
        # that send one vector are caught from that vector, whatever their history says.
        self._last = np.zeros((0, self.dim), dtype=np.float32)
        self._seen = np.zeros(0, dtype=np.int64)
        self.clock = 0

    def tick(self) -> None:
        """Start a new buffer: updates observed before it count as older by one."""
        self.clock += 1

    # -- sketches and histories

    def sketch(self, update: FlatVector) -> Floats:
        """The (dim,) count sketch of one update, or (n, dim) for a stack of updates."""
        if update.shape[-1] != self.size:
            raise AggregationError(f"update has {update.shape[-1]} values, expected {self.size}")
        return sketch_rows(update, dim=self.dim, seed=self.seed)

    def observe(self, client_id: str, sketch: Floats, *, factor: float = 1.0) -> None:
        """Add factor x sketch / ||sketch|| to the client's history.

        Call it whenever an update arrives (any order, any staleness); ``factor`` is the
        staleness discount, so stale updates shape the history less.
        """
        sketch = np.asarray(sketch, dtype=np.float64)
        if sketch.shape != (self.dim,):
            raise AggregationError(f"sketch has shape {sketch.shape}, expected ({self.dim},)")
        if not (math.isfinite(factor) and factor >= 0):
            raise AggregationError(f"factor must be non-negative and finite, got {factor}")
        length = float(np.linalg.norm(sketch))
        slot = self._slot(client_id)
        if length > 0 and math.isfinite(length):
            self._last[slot] = (sketch / length).astype(np.float32)
            self._seen[slot] = self.clock
            if factor > 0:
                self._hist[slot] += (factor / length * sketch).astype(np.float32)

    def _slot(self, client_id: str) -> int:
        slot = self._slots.get(client_id)
        if slot is not None:
            self._slots.move_to_end(client_id)
            return slot
        if len(self._slots) >= self.max_clients:
            _, slot = self._slots.popitem(last=False)
        elif self._free:
            slot = self._free.pop()
        else:
            slot = len(self._slots)
            if slot >= self._hist.shape[0]:
                grown = min(self.max_clients, max(64, 2 * self._hist.shape[0]))
                extra = grown - self._hist.shape[0]
                self._hist = np.concatenate([self._hist, np.zeros((extra, self.dim), np.float32)])
                self._last = np.concatenate([self._last, np.zeros((extra, self.dim), np.float32)])
                self._seen = np.concatenate([self._seen, np.full(extra, -(2**40), np.int64)])
        self._hist[slot] = 0.0
        self._last[slot] = 0.0
        self._seen[slot] = -(2**40)
        self._slots[client_id] = slot
        return slot

    def forget(self, client_id: str) -> None:
        """Drop a client's history (e.g. it left for good)."""
        slot = self._slots.pop(client_id, None)
        if slot is not None:
            self._hist[slot] = 0.0
            self._last[slot] = 0.0
            self._seen[slot] = -(2**40)
            self._free.append(slot)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The tracked clients (least recently observed first), their histories, their last
        updates with the tick each arrived at, and the clock."""
        ids = list(self._slots)
        rows = np.fromiter(self._slots.values(), dtype=np.intp, count=len(ids))
        return {"ids": np.array(ids, dtype=str), "hist": self._hist[rows].copy(),
                "last": self._last[rows].copy(), "seen": self._seen[rows].copy(),
                "clock": np.array([self.clock], dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Take back :meth:`state_dict`'s histories (same ``dim``; at most ``max_clients``)."""
        if "ids" not in state or "hist" not in state:
            raise AggregationError(f"Sybil state needs 'ids' and 'hist', got {sorted(state)}")
        ids = [str(i) for i in np.asarray(state["ids"]).ravel()]
        hist = np.asarray(state["hist"], dtype=np.float32).reshape(len(ids), -1) if ids else \
            np.zeros((0, self.dim), dtype=np.float32)
        if hist.shape != (len(ids), self.dim):
            raise AggregationError(f"Sybil histories have shape {hist.shape}, expected "
                                   f"({len(ids)}, {self.dim})")
        # A state saved before last updates were tracked has none: they start unseen.
        last = np.asarray(state.get("last", np.zeros((len(ids), self.dim))), dtype=np.float32)
        seen = np.asarray(state.get("seen", np.full(len(ids), -(2**40))), dtype=np.int64)
        if last.shape != hist.shape or seen.shape != (len(ids),):
            raise AggregationError(f"Sybil last updates have shape {last.shape} and {seen.shape}, "
                                   f"expected {hist.shape} and ({len(ids)},)")
        keep = slice(-self.max_clients, None)
        ids, hist, last, seen = ids[keep], hist[keep], last[keep], seen[keep]
        self._slots = OrderedDict((cid, i) for i, cid in enumerate(ids))
        self._free = []
        self._hist, self._last, self._seen = hist.copy(), last.copy(), seen.copy()
        self.clock = int(np.asarray(state.get("clock", [0])).ravel()[0])

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def state_nbytes(self) -> int:
        """Bytes held for histories: at most max_clients x dim x 4, whatever the model size."""
        return int(self._hist.nbytes + self._last.nbytes + self._seen.nbytes)

    # -- scores

    def max_similarity(self, client_ids: Sequence[str]) -> Floats:
        """Each client's largest cosine with any other tracked client (-1 if alone).

        Two cosines count: between histories (any tracked client), and between last updates
        for clients whose last update arrived within ``recent`` ticks of the newest. The second
        catches identities that built a distinct history and then switch to one shared vector:
        honest updates from distinct data are never near-identical.
        """
        missing = [c for c in client_ids if c not in self._slots]
        if missing:
            raise AggregationError(f"no history for client(s) {missing}; observe them first")
        slots = np.fromiter(self._slots.values(), dtype=np.intp, count=len(self._slots))
        if len(slots) < 2:
            return np.full(len(client_ids), -1.0)
        position = {slot: i for i, slot in enumerate(slots)}
        mine = np.array([position[self._slots[c]] for c in client_ids], dtype=np.intp)
        rows = np.arange(len(mine))
        hist = self._hist[slots].astype(np.float64)
        norms = np.linalg.norm(hist, axis=1)
        unit = np.divide(hist, norms[:, None], out=np.zeros_like(hist), where=norms[:, None] > 0)
        sims = unit[mine] @ unit.T
        sims[rows, mine] = -np.inf
        best: Floats = sims.max(axis=1)
        fresh = self._seen[slots] >= self.clock - self.recent
        if fresh.sum() >= 2:
            last = self._last[slots].astype(np.float64)
            recent_sims = last[mine] @ last[fresh].T
            recent_sims[:, :] = np.where(fresh[mine][:, None], recent_sims, -np.inf)
            cols = np.flatnonzero(fresh)
            where_self = np.searchsorted(cols, mine)
            own = (where_self < len(cols)) & (cols[np.minimum(where_self, len(cols) - 1)] == mine)
            recent_sims[rows[own], where_self[own]] = -np.inf
            best = np.maximum(best, recent_sims.max(axis=1))
        out: Floats = np.clip(best, -1.0, 1.0)
        return out

    def weights(self, client_ids: Sequence[str]) -> Floats:
        """Weight in [0, 1] per client: 1 for distinct histories, 0 for clones."""
        return similarity_weights(self.max_similarity(client_ids), low=self.low, high=self.high)


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
            sketches = self.scorer.sketch(x)
            self._sketches = sketches
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
        return weighted_sum(x, w / w.sum())

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


class RobustDefault(SybilMean):
    """The recommended rule: Sybil weights, a norm screen, then a per-coordinate Huber mean.

    1. Sybil weights s_i (:class:`SybilWeighting`: histories *and* last updates) find clone
       floods of any size, colluding attacks that send one shared vector (ALIE, IPM, Min-Max,
       Min-Sum) and identities that build a distinct history and then switch to one shared
       vector. Updates with s_i <= 1/2 get no vote.
    2. Updates longer than ``norm_cap`` x the median norm of the rest get no vote either: a
       minority of huge updates (boosted, or sign flipped and scaled) all sit at one end of
       every coordinate's order and would shift the median and widen the clipping range
       toward them. An honest update is rarely several times the median length.
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
                 head_c: float | None = None) -> None:
        super().__init__(size, dim=dim, max_clients=max_clients, seed=seed, low=low, high=high,
                         recent=recent, weight_cap=weight_cap)
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
        # This buffer's voters (views of its rows, which stay put until reset()).
        self._pending: list[tuple[str, FlatVector]] = []
        self._noted = False

    def voters(self, s: Floats, norms: Floats) -> npt.NDArray[np.intp]:
        """Rows that vote: non-clones of ordinary length."""
        rows = np.flatnonzero(s > 0.5)
        if rows.size and self.norm_cap is not None:
            bound = self.norm_cap * float(np.median(norms[rows]))
            rows = rows[norms[rows] <= bound]
        return rows

    def stat_rows(self, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """The voters whose median and MAD set the clipping range: all of them, or a subset of
        ``max_rows`` seeded by the buffer count (so ``result()`` is repeatable)."""
        if rows.size <= self.max_rows:
            return rows
        rng = np.random.default_rng([self.seed, self.scorer.clock])
        return np.sort(rng.choice(rows, size=self.max_rows, replace=False))

    def _robust(self, x: Stack, weights: Floats, factors: Floats, norms: Floats,
                ids: list[str]) -> FlatVector:
        s = self.sybil_weights(x, factors, ids)
        rows = self.voters(s, norms)
        self.last_voters = rows
        self.last_stat_rows = self.stat_rows(rows)
        if rows.size == 0:
            return np.zeros(self.size, dtype=np.float32)
        w = cap_weights(weights[rows], ratio=self.weight_cap)
        if not w.sum() > 0:  # every voter claimed no examples: one vote each
            w = np.ones(rows.size)
        stat = None if self.last_stat_rows.size == rows.size else self.last_stat_rows
        extra = self._history_rows(x, ids, rows)
        return huber_mean(x, c=self.huber_c, weights=w,
                          rows=None if rows.size == x.shape[0] else rows, stat_rows=stat,
                          extra=None if extra is None else self._past, extra_rows=extra,
                          tail=self.head, tail_c=self.head_c)

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
            self._pending = [(cid, x[r]) for cid, r in keep]
            self._noted = True
        room = self.max_rows - self.last_stat_rows.size
        picked = [cid for cid in reversed(self._past_slots) if cid not in here][:max(room, 0)]
        self.last_history = picked
        if not picked:
            return None
        return np.array([self._past_slots[cid] for cid in picked], dtype=np.intp)

    def reset(self) -> None:
        """Clear the buffer; its voters' rows become the newest history."""
        super().reset()
        for cid, row in self._pending:
            slot = self._past_slots.pop(cid, None)
            if slot is None:  # a free row while there is one, else the oldest client's
                slot = len(self._past_slots) if len(self._past_slots) < self.history \
                    else self._past_slots.popitem(last=False)[1]
            self._past[slot] = row
            self._past_slots[cid] = slot
        self._pending = []
        self._noted = False


register_aggregator("sybil", SybilMean)
register_aggregator("sybil-cclip", SybilCenteredClip)
register_aggregator("default", RobustDefault)
