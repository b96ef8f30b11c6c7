"""Sybil-resistant weights from bounded per-client update histories (the scorer).

The idea is FoolsGold's (Fung, Yoon and Beschastnikh, "The Limitations of Federated Learning in
Sybil Settings", https://arxiv.org/abs/1808.04866): many identities controlled by one attacker
push the same objective, so their accumulated updates stay far more alike than honest clients'
do, however non-IID the honest data. Such clients are down-weighted, and honest diversity keeps
its weight. What we do differently, and why:

* **Bounded state.** A client's history is a ``dim``-value count sketch (random signs, bucket =
  index mod ``dim``) of its updates, not a model-sized vector. Inner products of sketches
  estimate inner products of updates without bias (error about 1/sqrt(dim) in cosine). The
  signs come from a seeded generator, block by block; their bits are kept (one bit per
  coordinate: 1.25 MB for 10M values) so that a sketch's column units can run anywhere.
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

The aggregation rules built on these weights (``sybil``, ``sybil-cclip`` and ``default``)
are in :mod:`murmura.aggregation.sybil`.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from murmura.aggregation.base import AggregationError, FlatVector
from murmura.aggregation.client_rows import ClientRows
from murmura.aggregation.collusion import CollusionScreen
from murmura.aggregation.columns import THREADS, ColumnRunner, reduction_unit

#: The tick of a last update never seen (far older than any ``recent`` window).
_NEVER = -(2**40)

__all__ = ["SybilWeighting", "sign_bits", "similarity_weights", "sketch_rows", "sketch_unit"]

Floats = npt.NDArray[np.float64]

#: A gossip peer's collusion screen: z-score ramp and the peers it tracks before judging
#: (why these values: the comment in :class:`SybilWeighting`; the rule a peer mixes with
#: takes the same ones, gossip/mixing.py's ``GOSSIP_DEFAULT_OPTIONS``).
PEER_SCREEN_LOW, PEER_SCREEN_HIGH, PEER_SCREEN_MIN_CLIENTS = 0.7, 1.2, 6

# Columns sketched per block: temporaries stay bounded whatever the model size.
_SKETCH_COLUMNS = 8192


def sketch_rows(x: npt.ArrayLike, *, dim: int, seed: int, runner: ColumnRunner = THREADS,
                signs: npt.NDArray[np.uint8] | None = None) -> Floats:
    """Count sketch of each row of ``x`` (or of a single vector): shape (n, dim) or (dim,).

    Coordinate j goes to bucket j mod dim with a random sign drawn from ``seed``; the same seed
    always gives the same signs, so sketches of different updates are comparable. ``signs``:
    :func:`sign_bits` for these sizes, if the caller keeps them (where ``runner`` can share
    them); ``runner`` splits the columns into units whose partial sketches are added in order.
    """
    if dim < 1:
        raise AggregationError(f"sketch dim must be >= 1, got {dim}")
    single = np.ndim(x) == 1
    rows = np.atleast_2d(np.asarray(x, dtype=np.float32))
    n, p = rows.shape
    if signs is None:
        signs = _cached_sign_bits(p, dim, seed)
    elif signs.shape != ((p + 7) // 8,):
        raise AggregationError(f"sign bits have shape {signs.shape}, expected ({(p + 7) // 8},)")
    block = _sketch_block(dim)
    unit = reduction_unit(block)
    parts = np.zeros((max(-(-p // unit), 1), n, dim), dtype=np.float64)
    if p:
        runner.run(sketch_unit, {"x": rows, "signs": signs}, (dim, block, unit), parts, p,
                   unit=unit)
    out = parts[0].copy()
    for part in parts[1:]:
        out += part
    return out[0] if single else out


def _sketch_block(dim: int) -> int:
    """Columns sketched per step: a multiple of ``dim`` (whole buckets) and of 8 (whole bytes
    of sign bits), about :data:`_SKETCH_COLUMNS`."""
    return dim * max(8, math.ceil(_SKETCH_COLUMNS / dim / 8) * 8)


def sign_bits(p: int, dim: int, seed: int) -> npt.NDArray[np.uint8]:
    """The packed random sign bits of a ``p``-column sketch (bit j flips coordinate j)."""
    block = _sketch_block(dim)
    rng = np.random.Generator(np.random.PCG64(seed))
    # one draw per step of `block` columns, as the sketch was first defined: the same signs
    return np.concatenate([np.frombuffer(rng.bytes((min(block, p - a) + 7) // 8), np.uint8)
                           for a in range(0, p, block)] or [np.zeros(0, np.uint8)])


@functools.lru_cache(maxsize=8)
def _cached_sign_bits(p: int, dim: int, seed: int) -> npt.NDArray[np.uint8]:
    bits = sign_bits(p, dim, seed)
    bits.flags.writeable = False
    return bits


def sketch_unit(arrays: Mapping[str, np.ndarray | None], params: tuple[int, int, int],
                out: np.ndarray, a: int, b: int) -> None:
    """Kernel of :func:`sketch_rows`: the partial sketch of columns ``a..b`` (one unit)."""
    x, signs = arrays["x"], arrays["signs"]
    assert x is not None and signs is not None
    dim, block, unit = params
    n = x.shape[0]
    part = out[a // unit]
    part[...] = 0.0
    for lo in range(a, b, block):
        length = min(block, b - lo)
        bits = np.unpackbits(signs[lo // 8:(lo + length + 7) // 8], count=length)
        # Flip the IEEE sign bit where the random bit is set: exact, and one pass.
        flip = bits.astype(np.uint32) << np.uint32(31)
        chunk = np.ascontiguousarray(x[:, lo:lo + length])
        y = (chunk.view(np.uint32) ^ flip).view(np.float32)
        full = (length // dim) * dim
        if full:
            part += y[:, :full].reshape(n, -1, dim).sum(axis=1, dtype=np.float64)
        if full < length:  # lo is a multiple of dim: the rest starts at bucket 0
            part[:, : length - full] += y[:, full:]


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
        # Per client: its history, its last update (unit sketch) and the clock tick that
        # arrived at: clones that send one vector are caught from that vector, whatever their
        # history says.
        self._rows = ClientRows(self.max_clients, {
            "hist": ((self.dim,), np.float32, 0.0), "last": ((self.dim,), np.float32, 0.0),
            "seen": ((), np.int64, _NEVER)})
        self.clock = 0
        self._signs: tuple[ColumnRunner, npt.NDArray[np.uint8]] | None = None
        # Residual histories for the collusion screen of a standalone scorer (a gossip peer's
        # mixing, :func:`murmura.gossip.mixing.mix`): kept here so they live as long as the
        # scorer. Rows are allocated as clients arrive. Not part of :meth:`state_dict`.
        # A peer judges deltas from its own model, which shrink as the peers converge, so
        # honest z-scores are tighter than a server's: on the robustness benchmark's gossip
        # runs the honest neighbours' history z-scores stayed below 1.1 (90th percentile, in
        # every round) while distinct backdoor peers scored 1.4-5 from the fourth round on; a
        # server's thresholds (2.0 / 2.5) let half of the attackers' models through. A peer
        # tracks few neighbours early, so it starts judging from 6 of them instead of 16.
        self.screen: CollusionScreen | None = CollusionScreen(
            self.dim, max_clients=self.max_clients, low=PEER_SCREEN_LOW,
            high=PEER_SCREEN_HIGH, min_clients=PEER_SCREEN_MIN_CLIENTS, pair_low=0.65,
            pair_high=0.75, centre_extra=32)

    def tick(self) -> None:
        """Start a new buffer: updates observed before it count as older by one."""
        self.clock += 1

    # -- sketches and histories

    def sketch(self, update: FlatVector, runner: ColumnRunner = THREADS) -> Floats:
        """The (dim,) count sketch of one update, or (n, dim) for a stack of updates;
        ``runner`` runs its column units (with the sign bits in an array it allocated)."""
        if update.shape[-1] != self.size:
            raise AggregationError(f"update has {update.shape[-1]} values, expected {self.size}")
        if runner is THREADS:
            return sketch_rows(update, dim=self.dim, seed=self.seed)
        if self._signs is None or self._signs[0] is not runner:
            if self._signs is not None:
                self._signs[0].release(self._signs[1])
            bits = runner.allocate(((self.size + 7) // 8,), np.uint8)
            bits[...] = sign_bits(self.size, self.dim, self.seed)
            self._signs = (runner, bits)
        return sketch_rows(update, dim=self.dim, seed=self.seed, runner=runner,
                           signs=self._signs[1])

    def consistency(self, client_ids: Sequence[str], sketches: Floats) -> Floats:
        """Cosine of each sketch with its client's history so far (NaN for a client with no
        history): call it before :meth:`observe` adds the sketch. An honest client's updates
        keep pointing where its own data pulls, so this stays well above 0 (digits task: at
        least 0.17, median 0.9); a client that turns its updates around after building trust
        scores near or below 0 until its history follows (FLDetector's idea, Zhang et al.,
        KDD 2022, on the sketches the scorer already keeps)."""
        out = np.full(len(client_ids), np.nan)
        for i, cid in enumerate(client_ids):
            slot = self._slots.get(cid)
            if slot is None:
                continue
            hist = self._hist[slot].astype(np.float64)
            sketch = np.asarray(sketches[i], dtype=np.float64)
            norms = float(np.linalg.norm(hist)) * float(np.linalg.norm(sketch))
            if norms > 0 and math.isfinite(norms):
                out[i] = float(hist @ sketch) / norms
        return out

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

    # the rows, as the scorer reads them (the arrays are replaced when they grow)
    @property
    def _slots(self) -> OrderedDict[str, int]:
        return self._rows.slots

    @property
    def _hist(self) -> np.ndarray:
        return self._rows.arrays["hist"]

    @property
    def _last(self) -> np.ndarray:
        return self._rows.arrays["last"]

    @property
    def _seen(self) -> np.ndarray:
        return self._rows.arrays["seen"]

    def _slot(self, client_id: str) -> int:
        return self._rows.row(client_id)

    def forget(self, client_id: str) -> None:
        """Drop a client's history (e.g. it left for good)."""
        self._rows.forget(client_id)

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
        seen = np.asarray(state.get("seen", np.full(len(ids), _NEVER)), dtype=np.int64)
        if last.shape != hist.shape or seen.shape != (len(ids),):
            raise AggregationError(f"Sybil last updates have shape {last.shape} and {seen.shape}, "
                                   f"expected {hist.shape} and ({len(ids)},)")
        keep = slice(-self.max_clients, None)
        ids, hist, last, seen = ids[keep], hist[keep], last[keep], seen[keep]
        self._rows.load(ids, {"hist": hist, "last": last, "seen": seen})
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
