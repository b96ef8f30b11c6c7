"""Folds in the aggregation workers: partial aggregates in shared memory, merged per version.

Why: with decoding in workers, every update still went through one dense fold on the
publisher thread, so however many workers decoded, the tier could not take updates faster
than one thread folds them (it stopped gaining at 2-4 workers on 16 cores). LIFL (Qi,
Ramakrishnan & Lee, MLSys 2024) gets its scaling from the other shape: aggregation functions
fold locally and only partial aggregates travel up. That shape, for rules that fold update by
update (FedAvg and FedBuff, float32 or exact):

* The version being built (an *epoch*) has up to ``width`` *slots*: partial aggregates
  (weighted sum, total weight, count) in shared memory. The n-th update the policy folds in
  the epoch goes to slot ``n mod width`` and a worker folds it there (:func:`fold_job`). Folds
  into one slot run one after another in the policy's order, so a float32 rerun with the same
  width gives the same bits, and an exact run gives the flat run's bits whatever the width.
* A slot has two halves. A fold reads the current half and writes the new sum into the other;
  the gateway flips to it only once the job has returned. A worker that dies mid-fold leaves
  the current half untouched, so the backend's retry folds the update exactly once.
* At publish the epoch is sealed; once its folds are done, workers merge the slots pairwise
  (:func:`merge_job`, a fixed tree of log2(width) rounds) and check the result's range
  (:func:`check_job`). The publisher merges the one partial left into the rule: one pass per
  version instead of one per update.
* A fold that fails (its worker died on every attempt) leaves its update to the publisher,
  which folds it directly before the merge: nothing lost, nothing counted twice.

The gateway side (:class:`FoldSlots`) runs on the event loop, except :meth:`FoldSlots.finish`,
which the publisher calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from murmura.aggregation import Aggregator, ExactSum, Partial
from murmura.aggregation.fedavg import WeightedMean
from murmura.protocols.codecs import one_torch_thread
from murmura.server.decoding import Decoded, Decoder
from murmura.server.policy import fold_into
from murmura.server.slabs import Slab, SlabPool, SlabRef, attach
from murmura.server.workers import FunctionBackend

log = logging.getLogger(__name__)

#: (bound, folds pending normalisation, count, weight) of an exact partial: ExactSum.state().
ExactState = tuple[int, int, int, Fraction]
Release = Callable[[], None] | None
EMPTY: ExactState = (0, 0, 0, Fraction(0))

#: Below this many values a fold is cheaper on the publisher than a job's round trip
#: (~0.1-0.3 ms to pickle, send and answer against ~0.1 ms per million values folded).
MIN_VALUES = 1 << 16
#: Versions whose slots may be in use at once (being folded, or waiting for the publisher);
#: beyond that, updates are folded on the publisher until a version's slots come back.
MAX_EPOCHS = 8
#: The longest a publish waits for its version's folds and merges (workers that hang are
#: replaced by the backend long before; this only keeps the publisher from waiting forever).
FINISH_TIMEOUT_S = 300.0


# -- in the worker ---------------------------------------------------------------------------


#: A slot: two halves (the partial, and where the next fold writes), a 64-byte header
#: (the sequence numbers of the last in-place fold applied and of the undo values kept), and
#: room for those undo values (at most the model's size).
HEADER_BYTES = 64


def slot_bytes(n: int, exact: bool) -> int:
    """Bytes of one slot for ``n`` values."""
    half = (16 if exact else 4) * n
    return 2 * half + (HEADER_BYTES + 4 * n if not exact else 0)


def _halves(mem: memoryview, n: int, exact: bool
            ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The two halves of a slot: ``(values,)`` each, or ``(hi, lo)`` limbs when exact."""
    if not exact:
        return ((np.frombuffer(mem, np.float32, count=n),),
                (np.frombuffer(mem, np.float32, count=n, offset=4 * n),))
    half = 16 * n
    return tuple(  # type: ignore[return-value]
        (np.frombuffer(mem, np.int64, count=n, offset=h * half),
         np.frombuffer(mem, np.int64, count=n, offset=h * half + 8 * n)) for h in (0, 1))


def fold_job(slot: SlabRef, cur: int, first: bool, source: SlabRef, n: int, weight: float,
             factor: float, exact: ExactState | None, die_if: str | None = None, *,
             codec: str | None = None, decoder: Decoder | None = None, seq: int = 0,
             poison_if: str | None = None) -> tuple[ExactState | None, bool]:
    """See :func:`_fold`; ``poison_if`` (fault tests): when that file exists, the worker
    removes it and leaves a NaN in the sum, as a broken worker would."""
    state, flip = _fold(slot, cur, first, source, n, weight, factor, exact, die_if,
                        codec=codec, decoder=decoder, seq=seq)
    if poison_if is not None and exact is None and _claim(poison_if):
        _halves(attach(slot), n, False)[cur ^ int(flip)][0][0] = np.nan
    return state, flip


def _fold(slot: SlabRef, cur: int, first: bool, source: SlabRef, n: int, weight: float,
          factor: float, exact: ExactState | None, die_if: str | None = None, *,
          codec: str | None = None, decoder: Decoder | None = None, seq: int = 0
          ) -> tuple[ExactState | None, bool]:
    """Fold ``weight * factor * update`` into half ``cur`` of ``slot``; returns the exact
    sum's new state (None in float32 mode) and whether the sum moved to the other half.

    The update is float32 values at ``source``, or (``codec`` set) a payload at ``source``
    that the decoder checked and that is folded without decoding it: dequantise-and-add for
    int8/int4 in cache-sized steps, a scatter-add for top-k. A dense fold writes the sum into
    the other half (``first``: the slot is empty, the sum is the contribution alone) and is
    idempotent because half ``cur`` is only read. A sparse fold adds in place: it keeps the
    values it overwrites and the fold's ``seq`` in the slot's header first, so a rerun after
    a crash undoes a partial add and adds once. ``die_if`` (fault tests): when that file
    exists, the worker removes it and dies halfway through the fold.
    """
    torch.set_num_threads(1)  # one core per worker; the pool, not torch, uses the others
    mem = attach(slot)
    halves = _halves(mem, n, exact is not None)
    old, new = halves[cur], halves[1 - cur]
    alpha = float(weight) * float(factor)  # as WeightedMean.add scales
    dying = die_if is not None and _claim(die_if)
    if codec is not None:
        assert decoder is not None and exact is None
        c = decoder.codec(codec)
        payload = attach(source)
        sparse = c.sparse(payload, n)
        if sparse is not None and not first:
            _scatter(mem, n, old[0], *sparse, alpha, seq, dying=dying)
            return None, False
        if first:
            new[0].fill(0)
        if dying:
            os._exit(17)
        if sparse is not None:
            new[0][sparse[0]] += np.float32(alpha) * sparse[1]  # as TopKCodec.fold_into
        else:
            c.fold_into(payload, new[0] if first else old[0], new[0], alpha)
        return None, True
    src = np.frombuffer(attach(source), np.float32, count=n)
    if dying:
        new[0][: n // 2] = -1  # garbage a retry must overwrite
        os._exit(17)
    if exact is None:
        out, u = torch.from_numpy(new[0]), torch.from_numpy(src)
        if first:
            torch.mul(u, alpha, out=out)
        else:
            torch.add(torch.from_numpy(old[0]), u, alpha=alpha, out=out)
        return None, True
    if first:
        new[0].fill(0)
        new[1].fill(0)
        exact = EMPTY
    else:
        np.copyto(new[0], old[0])
        np.copyto(new[1], old[1])
    total = ExactSum.over(new[0], new[1], exact)
    total.add(src, weight, factor=factor)
    return total.state(), True


def _scatter(mem: memoryview, n: int, acc: np.ndarray, indices: np.ndarray,
             values: np.ndarray, alpha: float, seq: int, *, dying: bool) -> None:
    """``acc[indices] += alpha * values`` exactly once across reruns of fold ``seq``."""
    header = np.frombuffer(mem, np.int64, count=2, offset=8 * n)  # after both halves
    if header[0] == seq:
        return  # applied; the worker died before it could answer
    undo = np.frombuffer(mem, np.float32, count=indices.size, offset=8 * n + HEADER_BYTES)
    if header[1] == seq:
        acc[indices] = undo  # an earlier attempt may have added part of it
    else:
        undo[:] = acc[indices]
        header[1] = seq
    add = np.float32(alpha) * values
    if dying:
        half = indices.size // 2
        acc[indices[:half]] += add[:half]
        os._exit(17)
    acc[indices] += add
    header[0] = seq


def _claim(path: str) -> bool:
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def merge_job(into: SlabRef, cur: int, other: SlabRef, other_cur: int, n: int,
              exact: tuple[ExactState, ExactState] | None) -> ExactState | None:
    """Write ``into[cur] + other[other_cur]`` into the other half of ``into`` (idempotent as
    :func:`fold_job` is); returns the merged exact state (None in float32 mode)."""
    torch.set_num_threads(1)
    mine = _halves(attach(into), n, exact is not None)
    theirs = _halves(attach(other), n, exact is not None)[other_cur]
    old, new = mine[cur], mine[1 - cur]
    if exact is None:
        torch.add(torch.from_numpy(old[0]), torch.from_numpy(theirs[0]),
                  out=torch.from_numpy(new[0]))
        return None
    np.copyto(new[0], old[0])
    np.copyto(new[1], old[1])
    total = ExactSum.over(new[0], new[1], exact[0])
    total.merge(ExactSum.over(theirs[0], theirs[1], exact[1]))
    return total.state()


def check_job(slot: SlabRef, cur: int, n: int) -> float:
    """The largest magnitude in a float32 partial (inf if any value is not finite)."""
    torch.set_num_threads(1)
    values = torch.from_numpy(_halves(attach(slot), n, False)[cur][0])
    low, high = torch.aminmax(values)
    top = max(-float(low), float(high))
    return top if math.isfinite(top) else math.inf


# -- on the gateway --------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    slab: Slab
    cur: int = 0                     # the half that holds the partial
    count: int = 0
    weight: float = 0.0              # float32 mode; exact mode keeps it in ``state``
    state: ExactState | None = None  # exact mode
    tail: asyncio.Task[None] | None = None  # the last job on this slot
    jobs: int = 0                    # folds sent to it, ever (sequence numbers)

    @property
    def ref(self) -> SlabRef:
        return self.slab.ref(0, self.slab.nbytes)


@dataclass(eq=False)
class _Epoch:
    """The slots of one version being built."""

    aggregator: Aggregator
    slots: list[_Slot] = field(default_factory=list)
    taken: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: Updates whose fold failed in the workers: (decoded, weight, factor, client_id, release).
    fallback: list[tuple[Decoded, float, float, str, Release]] = field(default_factory=list)
    #: Every update given to the workers, in the policy's order (to rebuild the version).
    records: list[FoldRecord] = field(default_factory=list)


@dataclass(frozen=True)
class FoldRecord:
    """What rebuilding one update's fold needs: its codec, where its payload is spooled, the
    version it was trained on, and how it was weighted."""

    codec: str | None
    spooled: Any
    base_version: int | None
    weight: float
    factor: float
    client_id: str


class FoldSlots:
    """Folds accepted updates into per-version partial aggregates in the workers."""

    def __init__(self, backend: FunctionBackend, decoder: Decoder, *, size: int, exact: bool,
                 width: int) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.backend = backend
        self.decoder = decoder
        self.size = size
        self.exact = exact
        self.width = width
        self.slot_bytes = slot_bytes(size, exact)
        # Slots are kept for reuse (a fresh segment costs page faults in every worker that
        # maps it), at most MAX_EPOCHS versions' worth.
        self._pool = SlabPool(max(self.slot_bytes * width * MAX_EPOCHS, 1 << 20),
                              prefix="murmura_fold", idle_per_class=0)
        self._free: list[_Slot] = []
        self._epoch: _Epoch | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Fault tests: a file whose existence makes the worker of the next fold into a
        #: non-empty slot die mid-fold; one that makes the next fold leave a NaN in its sum.
        self.die_if: str | None = None
        self.poison_if: str | None = None
        #: Rebuilds a version on the publisher from the spooled payloads of its updates
        #: (set by the server when it keeps durable state): ``rebuild(records, aggregator)``.
        self.rebuild: Callable[[list[FoldRecord], Aggregator], None] | None = None
        self.rebuilt = 0
        self.folded = 0
        self.fallbacks = 0

    @staticmethod
    def suits(aggregator: Aggregator, update_size: int, *, forced: bool = False) -> bool:
        """Whether a run with this rule should fold in workers: a plain weighted mean (other
        rules need every update, or wrap it: DP clipping), large enough to be worth a job."""
        return type(aggregator) is WeightedMean and (forced or update_size >= MIN_VALUES)

    # -- the event loop's side ---------------------------------------------------------------

    def try_fold(self, decoded: Decoded, aggregator: Aggregator, weight: float,
                 factor: float = 1.0, *, client_id: str = "", release: Release = None) -> bool:
        """Fold ``decoded`` in a worker if it can be (its values in shared memory, the rule
        this epoch folds into, called on the event loop); False leaves it to the caller."""
        if decoded.shared is None or decoded.is_partial:
            return False
        if decoded.values is not None and decoded.values.size != self.size:
            return False
        if type(aggregator) is not WeightedMean or aggregator.exact != self.exact:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # replaying the spool at start-up: the publisher folds
            return False
        if self.loop is None:
            self.loop = loop
        epoch = self._epoch
        if epoch is None:
            epoch = self._epoch = _Epoch(aggregator)
        elif epoch.aggregator is not aggregator:
            return False
        index = epoch.taken % self.width
        while len(epoch.slots) <= index:
            fresh = self._slot()
            if fresh is None:  # many versions behind: fold this one on the publisher
                return False
            epoch.slots.append(fresh)
        epoch.taken += 1
        slot = epoch.slots[index]
        epoch.records.append(FoldRecord(decoded.codec, decoded.spooled, decoded.base_version,
                                        float(weight), float(factor), client_id))
        task = loop.create_task(self._fold(epoch, slot, slot.tail, decoded, weight, factor,
                                           client_id, release))
        slot.tail = task
        epoch.tasks.append(task)
        return True

    def dense(self, decoded: Decoded) -> None:
        """Decode an update that was only checked (its payload was to be folded in a worker),
        for a fold on the publisher instead."""
        if decoded.from_payload:
            assert decoded.shared is not None and decoded.codec is not None
            decoded.values = self.decoder.codec(decoded.codec).decode(
                attach(decoded.shared), self.size)

    def _slot(self) -> _Slot | None:
        """A free slot, or None when the slots of MAX_EPOCHS versions are all in use."""
        if self._free:
            return self._free.pop()
        slab = self._pool.acquire(self.slot_bytes)
        return _Slot(slab) if slab is not None else None

    async def _fold(self, epoch: _Epoch, slot: _Slot, before: asyncio.Task[None] | None,
                    decoded: Decoded, weight: float, factor: float, client_id: str,
                    release: Release) -> None:
        try:
            if before is not None and not before.done():
                await asyncio.wait([before])  # the fold before it on this slot, done or failed
            assert decoded.shared is not None
            slot.jobs += 1  # an in-place fold's sequence number (the same on a retry)
            try:
                state, flip = await self.backend.run_now(
                    fold_job, slot.ref, slot.cur, slot.count == 0, decoded.shared, self.size,
                    float(weight), float(factor), (slot.state or EMPTY) if self.exact else None,
                    self.die_if if slot.count else None,
                    codec=decoded.codec if decoded.from_payload else None,
                    decoder=self.decoder if decoded.from_payload else None, seq=slot.jobs,
                    poison_if=self.poison_if)
            except Exception as exc:  # noqa: BLE001 - the publisher folds it instead
                log.warning("folding an update in a worker failed (%s); the publisher folds "
                            "it", exc)
                epoch.fallback.append((decoded, weight, factor, client_id, release))
                release = None  # the publisher releases it after its fold
                self.fallbacks += 1
                return
            slot.cur ^= int(flip)
            slot.count += 1
            slot.weight += float(weight)
            slot.state = state
            self.folded += 1
        finally:
            if release is not None:
                release()

    def seal(self) -> _Epoch | None:
        """The epoch a publish takes (its slots get no more folds); the next fold opens a new
        one. Called by the policy's publish, on the event loop."""
        epoch, self._epoch = self._epoch, None
        return epoch

    # -- the publisher's side ----------------------------------------------------------------

    def finish(self, epoch: _Epoch | None, aggregator: Aggregator) -> None:
        """On the publisher: wait for the epoch's folds, have the workers merge its slots,
        and merge what is left into ``aggregator`` (normally one partial). Raises ValueError
        when the version cannot be made (a merged partial out of range, workers that never
        answered): the caller drops it, as any version that cannot be made."""
        if epoch is None:
            return
        assert self.loop is not None
        try:
            reduced = asyncio.run_coroutine_threadsafe(self._reduce(epoch), self.loop)
            try:
                reduced.result(FINISH_TIMEOUT_S)
            except FloatingPointError as exc:
                if self.rebuild is None or any(r.spooled is None or r.codec is None
                                           for r in epoch.records):
                    raise ValueError(f"{exc}; the version is dropped (without durable state "
                                     f"its updates cannot be folded again)") from None
                log.error("%s: rebuilding the version from the %d spooled updates", exc,
                          len(epoch.records))
                with one_torch_thread(self.size):
                    self.rebuild(epoch.records, aggregator)
                self.rebuilt += 1
                for slot in epoch.slots:
                    slot.count = 0  # the workers' partials are not used
                while epoch.fallback:  # in the records too: folded again above
                    release = epoch.fallback.pop()[-1]
                    if release is not None:
                        release()
            except concurrent.futures.TimeoutError:
                reduced.cancel()
                epoch.slots = []  # folds may still write them: never reuse them
                raise ValueError(f"the workers did not finish the version's folds within "
                                 f"{FINISH_TIMEOUT_S:g} s; the version is dropped") from None
            except Exception as exc:  # noqa: BLE001 - the slots are intact: merge them here
                log.warning("merging partial aggregates in the workers failed (%s); the "
                            "publisher merges them", exc)
            with one_torch_thread(self.size):
                while epoch.fallback:
                    decoded, weight, factor, client_id, release = epoch.fallback.pop(0)
                    try:
                        self.dense(decoded)
                        fold_into(decoded, aggregator, weight, factor=factor,
                                  client_id=client_id)
                    finally:
                        if release is not None:
                            release()
                for slot in epoch.slots:
                    if slot.count:
                        aggregator.merge(self._partial(slot))  # type: ignore[attr-defined]
        finally:
            for *_, release in epoch.fallback:  # a dropped version: give the buffers back
                if release is not None:
                    release()
            epoch.fallback.clear()
            self.loop.call_soon_threadsafe(self._recycle, epoch)

    def _partial(self, slot: _Slot) -> Partial:
        halves = _halves(slot.slab.buf, self.size, self.exact)[slot.cur]
        if self.exact:
            assert slot.state is not None
            total = ExactSum.over(halves[0], halves[1], slot.state)
            return Partial(total, total.total_weight, total.count)
        return Partial(halves[0], slot.weight, slot.count)

    async def _reduce(self, epoch: _Epoch) -> None:
        if epoch.tasks:
            await asyncio.wait(epoch.tasks)
        live = [s for s in epoch.slots if s.count]
        while len(live) > 1:  # pairs (0, 1), (2, 3), ...: a fixed tree, so a fixed sum
            await asyncio.gather(*(self._merge(a, b) for a, b in zip(live[0::2], live[1::2],
                                                                       strict=False)))
            live = live[0::2]
        if live and not self.exact:
            top = await self.backend.run_now(check_job, live[0].ref, live[0].cur, self.size)
            if not math.isfinite(top):
                raise FloatingPointError("a partial aggregate from the workers holds NaN or "
                                         "Inf")

    async def _merge(self, into: _Slot, other: _Slot) -> None:
        state = await self.backend.run_now(
            merge_job, into.ref, into.cur, other.ref, other.cur, self.size,
            (into.state, other.state) if self.exact else None)
        into.cur ^= 1
        into.count += other.count
        into.weight += other.weight
        into.state = state
        other.count, other.weight, other.state = 0, 0.0, None

    def _recycle(self, epoch: _Epoch) -> None:
        for slot in epoch.slots:
            slot.count, slot.weight, slot.state, slot.tail = 0, 0.0, None, None
            self._free.append(slot)
        epoch.slots.clear()

    # -- status ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"worker_folds": self.folded, "fold_fallbacks": self.fallbacks,
                "versions_rebuilt": self.rebuilt}

    def close(self) -> None:
        self._free.clear()
        self._pool.close()


__all__ = ["MIN_VALUES", "FoldSlots", "check_job", "fold_job", "merge_job"]
