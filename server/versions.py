"""Versions: the aggregator's job of turning folded updates into global versions.

Folding on the publisher, publishing a version (the rule's result, the optimizer or seed-pool
step, evaluation, the metrics row, the checkpoint, durably when the run keeps state),
installing it on the owner's thread, and serving models: the current one, a reference for
seed replay, and a seed pool's base and scalars. :class:`~murmura.server.core.AggregatorCore`
takes these methods from :class:`VersionsJob`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from murmura.aggregation import Aggregator
from murmura.protocols import (
    FlatVector,
    ModelSpec,
)
from murmura.protocols.codecs import one_torch_thread
from murmura.protocols.pool import seed_pool_for
from murmura.server.checkpoint import Checkpoint, save_checkpoint
from murmura.server.decoding import Decoded, check_range
from murmura.server.errors import (
    FailedPrecondition,
    ServiceError,
)
from murmura.server.model import BufferRule
from murmura.server.outputs import clean_row
from murmura.server.policy import fold_into
from murmura.server.pool import PoolState
from murmura.server.privacy import PrivacyBudgetSpent
from murmura.server.state import (
    Consume,
    PublishVersion,
)
from murmura.server.steadiness import SwingWatch, swing_advice
from murmura.server.store import fsync_dir

if TYPE_CHECKING:
    from murmura.server.folds import FoldRecord, FoldSlots

log = logging.getLogger(__name__)

Evaluator = Callable[[FlatVector], dict[str, float]]

REFERENCE_VERSIONS = 3
#: Versioned checkpoints of a durable run, under the output directory; the state database
#: names the current one, and ``checkpoint.npz`` is linked to it.
VERSIONS_DIR = "checkpoints"
#: Prefix of the aggregation rule's state arrays in a checkpoint (robust and Sybil rules).
AGG_PREFIX = "agg."


def link_current(out: Path, name: str, current: Path) -> None:
    """Point ``current`` (checkpoint.npz) at the committed versioned checkpoint ``name`` (a
    hard link swapped in atomically) and delete the other versioned checkpoints."""
    target = out / name
    tmp = current.with_name(current.name + ".link-tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
        os.replace(tmp, current)
        fsync_dir(current.parent)
    except OSError as exc:  # checkpoint.npz is a convenience copy; the store is the truth
        log.warning("could not update %s: %s", current, exc)
    for p in (out / VERSIONS_DIR).glob("v*.npz"):
        if p.name != target.name:
            p.unlink(missing_ok=True)


def evaluator_for(model_factory: Callable[[], Any], spec: ModelSpec, data: Any,
                  measure: Callable[[Any, Any], dict[str, float]] | None = None) -> Evaluator:
    """An evaluator that loads the global vector into one model and measures it on ``data``
    (with ``measure(model, data)``, an app's own evaluate; default accuracy and loss)."""
    from murmura.tasks import evaluate

    model = model_factory()
    measure = measure or evaluate

    def run(params: FlatVector) -> dict[str, float]:
        spec.load_into(model, params)
        return measure(model, data)

    return run


class VersionsJob:
    """Global versions: folding, publishing, installing, serving (mixed into the core)."""

    #: attributes this job assigns (declared in AggregatorCore.__init__)
    version: int
    params: FlatVector
    done: bool
    ready: bool
    publishing: int
    publishes: int
    last_publish: Future[Any] | None
    last_metrics: dict[str, Any]
    fold_mass: float
    _batch: list[int]
    _pub_params: FlatVector
    _pub_version: int
    _pool_scalars: FlatVector
    buffers: BufferRule | None
    swings: SwingWatch
    folds: FoldSlots | None

    if TYPE_CHECKING:  # the core's state, typed where AggregatorCore declares it
        def __getattr__(self, name: str) -> Any: ...


    def model(self, session: str) -> tuple[int, FlatVector]:
        """The current global version and vector (never modified in place: safe to stream)."""
        self._checked(self._record, session)
        return self.version, self.params

    def pool_base(self, session: str) -> tuple[int, FlatVector]:
        """The seed pool's base model and the version it was taken at (read-only)."""
        self._checked(self._record, session)
        pool = self._checked(self._require_pool)
        return pool.base_version, pool.base

    def pool_scalars(self, session: str) -> tuple[int, int, FlatVector]:
        """``(version, base_version, scalars)``: the K numbers that, replayed on the base with
        ``apply_pool``, give the current global model exactly."""
        self._checked(self._record, session)
        pool = self._checked(self._require_pool)
        return self.version, pool.base_version, self._pool_scalars

    def _require_pool(self) -> PoolState:
        if self.pool is None:
            raise FailedPrecondition("this run has no seed pool (it needs trainer 'zo', codec "
                                     "'seed' and codec option pool=K); pull the model instead")
        return self.pool

    def _start_pool(self, start: Checkpoint | None) -> PoolState | None:
        """The FedKSeed state when the settings ask for a seed pool (see server/pool.py)."""
        pool = seed_pool_for(self.config.train)
        if pool is None:
            return None
        meta = {"k": len(pool), "base_seed": pool.base_seed}
        if start is not None and "pool.cumulative" in start.extra:
            if start.meta.get("pool") != meta:
                raise ValueError(f"checkpoint's seed pool {start.meta.get('pool')} is not this "
                                 f"run's {meta}; resume with the same seed and pool size")
            return PoolState(pool, start.extra["pool.base"],
                             base_version=int(start.extra["pool.base_version"][0]),
                             cumulative=start.extra["pool.cumulative"])
        # A fresh pool starts from the current model (the initial one, or a checkpoint's).
        return PoolState(pool, self.params, base_version=self.version)

    def fold(self, fn: Callable[..., None], decoded: Decoded, *args: Any,
             release: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """Run ``fn(decoded, *args, **kwargs)`` (an accumulator update) on the publisher, after
        the jobs before it; then ``release``, with no reference to ``decoded`` left here (a
        receive buffer is reused only when nothing else holds it).

        With :attr:`folds` (a weighted mean on a worker tier) the fold of an update whose
        values lie in shared memory runs in a worker instead, into a partial aggregate that
        the version's publish merges (server/folds.py)."""
        folds = self.folds
        if folds is not None and fn is fold_into and self.buffers is None:
            if folds.try_fold(decoded, *args, release=release, **kwargs):
                return
            folds.dense(decoded)  # it was only checked, for a fold in a worker
        box = [decoded]

        def run() -> None:
            try:
                with one_torch_thread(self.update_size):  # a memory-bound fold: one core
                    if self.buffers is not None:  # re-based on the model it is folded onto
                        self.buffers.take(box[0], self._pub_params,
                                          accumulate=self.forward is None)
                    fn(box.pop(), *args, **kwargs)
            finally:
                if release is not None:
                    release()
        # Decoded updates are checked before they are folded, so an error here is a bug,
        # not bad input: it is logged and the update is not in the aggregate.
        self.publisher.post(run, what="folding an update (it is not in the aggregate)")

    def refold(self, records: list[FoldRecord], aggregator: Aggregator) -> None:
        """On the publisher: fold a version's updates again from their spooled payloads, in
        the policy's order (the workers' partial aggregate of it was damaged)."""
        assert self.store is not None
        for r in records:
            assert r.codec is not None and r.spooled is not None
            payload = memoryview(bytearray(self.store.read_payload(r.spooled)))
            reference = (self._history.get(r.base_version)
                         if self.decoder.needs_reference(r.codec) else None)
            decoded = self.decoder.decode(r.codec, payload, reference=reference)
            fold_into(decoded, aggregator, r.weight, factor=r.factor, client_id=r.client_id)

    def publish(self, aggregator: Aggregator, *, updates: int,
                round_id: int = 0, detail: dict[str, Any] | None = None) -> None:
        """Make what ``aggregator`` holds the next global version (a leaf: send it upstream).

        Called by the policy on the owner's thread. The aggregate, the optimizer step,
        evaluation, the metrics row and the checkpoint run on the publisher after every fold
        submitted before; the new version is installed on the owner's thread when they are done.
        ``detail``: the policy's own figures for the metrics row (e.g. the buffer's staleness).
        """
        self.publishing += 1
        self.fold_mass = 0.0  # later folds go into the next aggregate (the publisher is FIFO)
        folds = self.folds
        epoch = folds.seal() if folds is not None else None  # the workers' partials
        if self.forward is not None:
            forward = self.forward
            self.client_evals.flush()  # a leaf writes no rows; its parent's clients report
            if self.client_train is not None:
                self.client_train.flush()

            def send() -> None:
                if folds is not None:
                    folds.finish(epoch, aggregator)
                forward(aggregator, updates)
            self.publisher.submit(send)
            return
        row: dict[str, Any] = {
            "round": round_id,
            "time_s": round(self.clock() - self.t0, 6),
            "updates": self.traffic.updates,
            "updates_in_version": updates,
            "bytes_up": self.traffic.bytes_up,
            "bytes_down": self.traffic.bytes_down,
            "clients": len(self.sessions),
            "refused": dict(sorted(self.traffic.refused.items())),  # by gRPC status
            "refused_by_reason": dict(sorted(self.traffic.refused_by_reason.items())),
        }
        row.update(detail or {})
        row.update(self.client_evals.flush())
        if self.client_train is not None:  # clients' training metrics (server/client_train.py)
            row.update(self.client_train.flush())
        if self.row_extras is not None:
            row.update(self.row_extras())
        if self.privacy is not None:  # the version's DP denominator and sampling rate
            row.update(self.privacy.plan(len(getattr(self.policy, "cohort", ())),
                                         len(self.sessions)))
        seqs, self._batch = self._batch, []
        fut = self.publisher.submit(lambda: self._make_version(aggregator, row, seqs, epoch))
        fut.add_done_callback(lambda f: self.post(lambda: self._install(f)))
        self.publishes += 1
        self.last_publish = fut

    def _make_version(self, aggregator: Aggregator, row: dict[str, Any],
                      seqs: list[int] | None = None, epoch: Any = None
                      ) -> tuple[FlatVector, dict[str, Any], Any]:
        """On the publisher thread: aggregate, step, evaluate, record, checkpoint."""
        t0 = time.perf_counter()
        try:
            if epoch is not None and self.folds is not None:  # the workers' partials first
                self.folds.finish(epoch, aggregator)
            if self.privacy is not None:  # PrivacyBudgetSpent: over --dp-target-epsilon
                self.privacy.admit(aggregator, row, self._pub_version + 1)
            try:
                delta = aggregator.result()
                self.telemetry.took_weights(aggregator)  # per-update weights, if the rule has
            finally:
                aggregator.reset()
            if self.buffers is not None:  # buffers are averaged, never stepped
                delta = self.buffers.without(delta)
            with np.errstate(over="ignore", invalid="ignore"):  # checked just below
                params = self.rule.advance(self._pub_params, delta)  # ValueError: dropped
            if self.buffers is not None:
                self.buffers.settle(params, self._pub_params)
            try:
                check_range(params, "the new global model")
            except ServiceError as exc:  # e.g. a server optimizer's step overflowed
                raise ValueError(f"{exc.message}; the version is dropped") from None
        except ValueError:
            if self.buffers is not None:
                self.buffers.reset()
            if self.store is not None and seqs:  # its updates are spent: never replay them
                self.store.submit(Consume(tuple(seqs)), publishes=True)
            raise
        t1 = time.perf_counter()
        self._pub_params = params
        self._pub_version += 1
        if self.buffers is not None:
            self.buffers.remember(self._pub_version, params)
        row = {"version": self._pub_version, **row, "aggregate_s": round(t1 - t0, 6)}
        if self.privacy is not None:
            row.update(self.privacy.released(aggregator))
        if self.evaluator is not None:
            row.update(self._evaluate(params))
            self._watch_swings(row)
        if self.store is not None:
            self._publish_durably(params, aggregator, clean_row(row), seqs or [])
        else:
            if self.recorder is not None:
                self.recorder.record(row)
            if self.checkpoint_path is not None:
                save_checkpoint(self.checkpoint_path,
                                self._checkpoint(params, aggregator, row))
        row["publish_s"] = round(time.perf_counter() - t0, 6)
        scalars = self.pool.scalars if self.pool is not None else None
        return params, row, scalars

    def _watch_swings(self, row: dict[str, Any]) -> None:
        """Warn once when the accuracy swings from version to version (server/steadiness.py)."""
        accuracy = row.get("accuracy")
        drops = self.swings.see(row["version"], accuracy if isinstance(accuracy, float)
                                else None)
        if drops:
            cfg = self.config
            log.warning("%s", swing_advice(drops, mode=cfg.mode,
                                           buffer_size=cfg.policy.buffer_size,
                                           clients=int(row.get("clients", 0)),
                                           server_lr=cfg.policy.server_lr))

    def _evaluate(self, params: FlatVector) -> dict[str, Any]:
        """The evaluator's metrics of a new version; none when it fails. The version is
        published all the same: a broken evaluation must not drop every aggregate (the run
        would never reach max_versions), so it is logged instead."""
        assert self.evaluator is not None
        try:
            return dict(self.evaluator(params))
        except Exception as exc:  # noqa: BLE001 - the app's code, reported as such
            log.error("version %d is published without the server's evaluation, which "
                      "failed: %s", self._pub_version, exc,
                      exc_info=not isinstance(exc, ValueError))
            return {}

    def _checkpoint(self, params: FlatVector, aggregator: Aggregator,
                    row: dict[str, Any]) -> Checkpoint:
        optimizer_state, meta, extra = self.rule.checkpoint_state()
        extra = dict(extra)
        extra.update({AGG_PREFIX + k: v for k, v in aggregator.state_dict().items()})
        counters: dict[str, Any] = {k: row[k] for k in ("updates", "bytes_up", "bytes_down",
                                                    "time_s")
                    if k in row}
        return Checkpoint(version=self._pub_version, params=params,
                          spec_fingerprint=self.fingerprint, optimizer_state=optimizer_state,
                          meta={"mode": self.config.mode, **counters, **meta}, extra=extra)

    def _crash_point(self, step: str) -> None:
        if self.crash_hook is not None:
            self.crash_hook(step)

    def _publish_durably(self, params: FlatVector, aggregator: Aggregator,
                         row: dict[str, Any], seqs: list[int]) -> None:
        """Publish as one atomic step: the checkpoint file (named after its version) first,
        then one commit that records the row, makes that file current and consumes the
        version's pending updates; only then the metrics line and ``checkpoint.npz``.

        A crash before the commit leaves the old version (its pending updates replay, the
        orphan file is deleted at start-up); after it, the new one (``metrics.jsonl`` is
        rewritten from the committed rows at start-up, so no line is lost or doubled).
        """
        assert self.store is not None and self.checkpoint_path is not None
        out = self.checkpoint_path.parent
        name = f"{VERSIONS_DIR}/v{self._pub_version:08d}.npz"
        save_checkpoint(out / name, self._checkpoint(params, aggregator, row))
        self._crash_point("checkpoint_written")
        fut = self.store.submit(PublishVersion(self._pub_version, row, name, tuple(seqs)),
                                counters=None, publishes=True)
        fut.add_done_callback(self._check_store)
        fut.result()  # the publisher waits; the event loop does not
        self._crash_point("committed")
        if self.recorder is not None:
            self.recorder.record(row)
        self._crash_point("recorded")
        link_current(out, name, self.checkpoint_path)

    def _install(self, fut: Any) -> None:
        """On the owner's thread: the publisher's new version becomes the global one."""
        self.publishing -= 1
        try:
            params, row, scalars = fut.result()
        except PrivacyBudgetSpent as exc:  # the run ends cleanly, before that version
            assert self.privacy is not None
            self.privacy.stopped(exc)
            self.stop()
            return
        except Exception as exc:
            log.error("aggregate dropped, the global model is unchanged: %s", exc,
                      exc_info=not isinstance(exc, ValueError))
            self._changed()
            return
        self.install(row["version"], params, row=row, pool_scalars=scalars)

    def install(self, version: int, params: FlatVector, *,
                row: dict[str, Any] | None = None,
                pool_scalars: FlatVector | None = None) -> None:
        """Make ``params`` global version ``version`` (a leaf: the version its parent sent)."""
        self.version = version
        self.params = params
        self.ready = True
        if self.forward is not None:
            self.publishing = 0
            self._pub_params, self._pub_version = params, version
            if self.buffers is not None:
                self.buffers.remember(version, params)
        if pool_scalars is not None:
            self._pool_scalars = pool_scalars
        self._history[version] = params
        while len(self._history) > REFERENCE_VERSIONS:
            self._history.popitem(last=False)
        if row is not None:
            self.last_metrics = row
            self.telemetry.published()
            log.info("version %d: %s", version,
                     ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items() if k != "version"))
        if self.forward is None and self.version >= self.config.max_versions:
            self.done = True
        self._changed()
