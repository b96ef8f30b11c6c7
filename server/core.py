"""The aggregator's domain logic, independent of any transport.

The gRPC servicer and the simulation's in-memory transport both drive this class: it validates
every request, keeps the client registry, hands each decoded update to the round policy as it
arrives, and publishes new global versions (optimizer step, evaluation, metrics, checkpoint).
It is not thread-safe: drive it from one thread or one event loop.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from murmura.aggregation import Aggregator, create_optimizer
from murmura.protocols import (
    Action,
    DeviceProfile,
    FlatVector,
    ModelSpec,
    Task,
    UpdateHeader,
)
from murmura.protocols.identity import (
    load_public_keys,
)
from murmura.server.checkpoint import Checkpoint
from murmura.server.client_eval import ClientEvals
from murmura.server.client_train import ClientTrainMetrics
from murmura.server.compass_policy import CompassPolicy
from murmura.server.config import ServerConfig
from murmura.server.decoding import Decoder
from murmura.server.errors import (
    ServiceError,
)
from murmura.server.intake import MAX_PARTIAL_COUNT, IntakeJob
from murmura.server.model import BufferRule, ModelRule, OptimizerRule, PoolRule
from murmura.server.outputs import RunRecorder
from murmura.server.policy import AsyncPolicy, Policy, PolicyHost, SyncPolicy
from murmura.server.privacy import PrivacyStage
from murmura.server.publisher import Publisher
from murmura.server.ratelimit import RateLimiter
from murmura.server.recent import RecentMap
from murmura.server.sessions import (
    CHALLENGE_TTL_S,
    LOST_GRACE_S,
    MAX_CHALLENGES,
    NONCE_BYTES,
    ClientRecord,
    SessionsJob,
)
from murmura.server.state import (
    AggregatorState,
    PendingUpdate,
    StoredState,
    Touch,
)
from murmura.server.steadiness import SwingWatch
from murmura.server.telemetry import Telemetry
from murmura.server.versions import (
    AGG_PREFIX,
    REFERENCE_VERSIONS,
    VERSIONS_DIR,
    Evaluator,
    VersionsJob,
    evaluator_for,
    link_current,
)

if TYPE_CHECKING:
    from murmura.server.folds import FoldSlots
    from murmura.server.pipeline import PushPipeline

log = logging.getLogger(__name__)

SEEN_UPDATES = 100_000
JOIN_BURST = 10
PUSH_BURST = 50
#: What one version's aggregate may hold, as a sum over its updates of max |value| x weight:
#: below float32's 3.4e38 with headroom, or the exact accumulator's range (sum of max
#: |contribution| < 2**42, see aggregation/partial.py). Bounding the sum before each fold proves
#: that no fold overflows, whatever the rule does with weights <= 1 (staleness factors are).
FOLD_LIMIT = {"float32": 1e38, "exact": 0.99 * 2.0**42}
#: How often (seconds) the tick writes counters that changed without a commit (downloads).
COUNTERS_EVERY_S = 2.0


@dataclass
class Traffic:
    bytes_up: int = 0
    bytes_down: int = 0
    updates: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by gRPC status
    #: The same refusals by ``STATUS: reason`` (ServiceError.key): what went wrong, in short.
    refused_by_reason: dict[str, int] = field(default_factory=dict)


#: Forwards a leaf's partial aggregate upstream: ``forward(aggregator, updates)`` runs on the
#: publisher thread, takes the aggregator's partial and resets it.
Forward = Callable[[Aggregator, int], None]


class AggregatorCore(SessionsJob, IntakeJob, VersionsJob):
    """Validates requests and turns updates into global versions under a policy.

    Taking an update in has three steps, so a transport can run the middle one elsewhere:
    :meth:`begin_push` (checks that need only the header and the payload's length),
    decoding (:attr:`decoder`, pure: inline, in a worker process or on Ray) and
    :meth:`finish_push` (the state may have changed meanwhile, so staleness and the session are
    checked again; then the policy takes the update). :meth:`push` does all three inline.

    Folding and publishing run on :attr:`publisher` (inline unless the server gives it a
    thread); a published version is installed through ``post``, which runs a function on the
    thread that owns the core (the event loop), so the core's state is only ever changed there.
    """

    def __init__(self, config: ServerConfig, spec: ModelSpec, initial: FlatVector, *,
                 evaluator: Evaluator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 recorder: RunRecorder | None = None,
                 checkpoint_path: str | Path | None = None,
                 start: Checkpoint | None = None,
                 store: AggregatorState | None = None,
                 stored: StoredState | None = None) -> None:
        spec.check_vector(initial)
        self.config = config
        self.spec = spec
        self.fingerprint = spec.fingerprint()
        self.clock = clock
        self.evaluator = evaluator
        self.recorder = recorder
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.version = 0
        self.params: FlatVector = np.array(initial, dtype=np.float32, copy=True)
        security = config.security
        optimizer = create_optimizer(config.policy.optimizer, lr=config.policy.server_lr)
        if start is not None:
            if start.spec_fingerprint != self.fingerprint:
                raise ValueError(f"checkpoint is for model spec {start.spec_fingerprint}, "
                                 f"this server's spec is {self.fingerprint}")
            spec.check_vector(start.params)
            self.version, self.params = start.version, start.params.copy()
            optimizer.load_state_dict(start.optimizer_state)
        self.decoder = Decoder(spec.size, config.train, hash_payloads=security.require_identity)
        #: Public keys allowed to join (None: any key that proves itself).
        self.allowed_keys = (load_public_keys(security.allowed_keys) if security.allowed_keys
                             else None)
        #: Public keys of the leaf aggregators that may push partial aggregates.
        self.leaf_keys = load_public_keys(security.leaf_keys) if security.leaf_keys else frozenset()
        self._challenges: OrderedDict[bytes, float] = OrderedDict()
        #: SHA-256 of counted payloads -> the client they were counted from (bounded in
        #: entries and age, like the other memories of past requests below).
        self._counted: RecentMap[bytes, str] = RecentMap(SEEN_UPDATES, security.dedup_ttl_s, clock)
        pool = self._start_pool(start)
        #: The FedKSeed state in a seed-pool run (see server/pool.py), else None.
        self.pool = pool
        self.rule: ModelRule = (PoolRule(pool, lr=config.policy.server_lr) if pool is not None
                                else OptimizerRule(optimizer))
        if pool is not None:
            self.params = pool.model()
            self._pool_scalars = pool.scalars
        #: Length of the vectors the policy aggregates: the model, or K pool coordinates.
        self.update_size = self.decoder.update_size
        self._history: OrderedDict[int, FlatVector] = OrderedDict({self.version: self.params})
        self.sessions: dict[str, ClientRecord] = {}
        self._session_of: dict[str, str] = {}
        self._left: RecentMap[str, str] = RecentMap(SEEN_UPDATES, security.dedup_ttl_s, clock)
        #: Sessions from least to most recently used, for expiry.
        self._last_seen: OrderedDict[str, float] = OrderedDict()
        #: Sessions whose waiting call was cancelled by the client's side, and when.
        self._lost: dict[str, float] = {}
        self._join_limit = RateLimiter(security.join_per_s, JOIN_BURST)
        self._push_limit = RateLimiter(security.push_per_s, PUSH_BURST)
        #: Counted (client id, update id) -> staleness: a retried push is answered as a
        #: duplicate for as long as a client may retry it.
        self._seen: RecentMap[tuple[str, str], int] = RecentMap(SEEN_UPDATES,
                                                                security.dedup_ttl_s, clock)
        self._inflight: set[tuple[str, str]] = set()
        #: The last headers check_header passed, by id (a header is checked at precheck and
        #: again at begin_push; several pushes are received at once over gRPC)
        self._valid_headers: OrderedDict[int, UpdateHeader] = OrderedDict()
        self.traffic = Traffic()
        self.telemetry = Telemetry(self)  # what the run is doing (server/telemetry.py)
        #: Durable state (server/store.py): a push is acknowledged once it is on disk there.
        self.store = store
        if store is not None and self.checkpoint_path is None:
            raise ValueError("durable state needs a checkpoint path (the output directory)")
        #: The future of the last durable operation a request started (the transport awaits
        #: it before answering), or None.
        self.last_durable: Future[Any] | None = None
        #: Set when the state store failed: no update is acknowledged any more.
        self.store_error: BaseException | None = None
        self._seq = 0                  # numbers accepted updates (the store's pending rows)
        self._batch: list[int] = []    # accepted since the last publish: the next version's
        self._counters_at = 0.0
        #: Counted updates whose commit is not done yet, with its future.
        self._committing: dict[tuple[str, str], Future[Any]] = {}
        self._counters_seen: tuple[int, int, int] = (0, 0, 0)
        #: Tests: called with the name of each step of a durable publish (to inject a crash).
        self.crash_hook: Callable[[str], None] | None = None
        self._pipeline: PushPipeline | None = None
        elapsed = 0.0
        if stored is not None:
            elapsed = self._restore(stored)
        elif start is not None:  # a checkpoint alone: its counters continue
            elapsed = self._restore_counters(start.meta)
        self.done = self.version >= config.max_versions
        self.t0 = clock() - elapsed  # time_s continues where the last run left it
        self.last_metrics: dict[str, Any] = {}
        #: Clients' evaluation reports waiting for the next metrics row (server/client_eval.py).
        self.client_evals = ClientEvals()
        #: Clients' training metrics for the rows; None (off) unless a run turns it on
        #: (a Flower app's: server/flower.py).
        self.client_train: ClientTrainMetrics | None = None
        self._listeners: list[Callable[[], None]] = []
        #: Runs folds and publishing in order; a server gives it a thread (see publisher.py).
        self.publisher = Publisher(threaded=False)
        #: Runs a function on the thread that owns the core; the server sets it to its loop's
        #: ``call_soon_threadsafe``.
        self.post: Callable[[Callable[[], object]], object] = _call_now
        #: Versions handed to the publisher and not yet installed.
        self.publishing = 0
        #: Publishes started, and the future of the last one (a transport may await it so the
        #: push that completed a version answers with that version).
        self.publishes = 0
        self.last_publish: Future[Any] | None = None
        #: Watches the published versions' accuracy for swings (server/steadiness.py).
        self.swings = SwingWatch()
        self._pub_params = self.params        # the publisher thread's view of the model
        self._pub_version = self.version
        #: Buffers (BatchNorm statistics) are averaged, not stepped (server/model.py); None
        #: for a model without any. Kept for every version an update may still be trained on.
        self.buffers = (BufferRule.for_spec(spec, self.params, self.version,
                                            keep=config.policy.max_staleness + 2)
                        if self.update_size == spec.size else None)  # not a seed pool's
        #: Set on a leaf aggregator: publishing forwards the partial upstream instead.
        self.forward: Forward | None = None
        #: False while a leaf waits for its parent's first model: clients are told to wait.
        self.ready = True
        #: Sum of max |value| x weight of the updates folded since the last publish; an update
        #: that would take it past ``fold_limit`` is refused (see FOLD_LIMIT).
        self.fold_mass = 0.0
        self.fold_limit = FOLD_LIMIT[config.policy.accumulator]
        #: Folds in the aggregation workers (server/folds.py), set by the server when its
        #: tier has process workers and the rule folds update by update; None: the publisher
        #: folds every update.
        self.folds: FoldSlots | None = None
        #: Extra figures for the metrics row (the serverless tier's workers and queue).
        self.row_extras: Callable[[], dict[str, Any]] | None = None
        #: Client-level differential privacy (server/privacy.py), None when off.
        self.privacy = PrivacyStage.for_run(config, has_buffers=self.buffers is not None,
                                            seed=self.derive_seed("dp-noise"), recorder=recorder)
        policies: dict[str, Callable[[PolicyHost], Policy]] = {
            "sync": SyncPolicy, "async": AsyncPolicy, "compass": CompassPolicy}
        if config.privacy.secure_aggregation:  # masked sync rounds (server/secagg_policy.py)
            if self.buffers is not None or self.pool is not None:
                raise ValueError("secure aggregation masks the model's trained values only: "
                                 "models with BatchNorm buffers and seed pools are refused "
                                 "(use GroupNorm or LayerNorm, and the dense codec)")
            from murmura.server.secagg_policy import SecAggAsyncPolicy, SecAggPolicy

            policies["sync"], policies["async"] = SecAggPolicy, SecAggAsyncPolicy
        self.policy: Policy = policies[config.mode](self)  # the policy sees a PolicyHost
        if start is not None:
            agg_state = {k[len(AGG_PREFIX):]: v for k, v in start.extra.items()
                         if k.startswith(AGG_PREFIX)}
            if agg_state:
                self.policy.aggregator.load_state_dict(agg_state)
        if stored is not None and stored.rows:
            self.policy.restore_round(int(stored.rows[-1].get("round", 0)))

    # -- durable state ------------------------------------------------------------------------

    def _restore_counters(self, counters: dict[str, Any]) -> float:
        self.traffic.updates = int(counters.get("updates", 0))
        self.traffic.bytes_up = int(counters.get("bytes_up", 0))
        self.traffic.bytes_down = int(counters.get("bytes_down", 0))
        self.traffic.refused = {str(k): int(v) for k, v in
                                dict(counters.get("refused", {})).items()}
        self.traffic.refused_by_reason = {str(k): int(v) for k, v in
                                          dict(counters.get("refused_by_reason", {})).items()}
        return float(counters.get("time_s", 0.0))

    def _restore(self, stored: StoredState) -> float:
        """Sessions, counted update ids and counters as the store kept them."""
        now = self.clock()
        for session, client_id, profile, _, public_key in stored.sessions:
            self.sessions[session] = ClientRecord(session, client_id, DeviceProfile(**profile),
                                                  now, last_seen=now, public_key=public_key)
            self._last_seen[session] = now  # a restart counts as use: expiry starts over
            self._session_of[client_id] = session
        for client_id, update_id, staleness in stored.seen:
            self._seen[(client_id, update_id)] = staleness
        self._seq = max([int(stored.counters.get("seq", 0))] + [p.seq for p in stored.pending])
        return self._restore_counters(stored.counters)

    def counters(self) -> dict[str, Any]:
        """What the store keeps of the counters; they continue after a restart."""
        return {"updates": self.traffic.updates, "bytes_up": self.traffic.bytes_up,
                "bytes_down": self.traffic.bytes_down, "refused": dict(self.traffic.refused),
                "refused_by_reason": dict(self.traffic.refused_by_reason),
                "time_s": round(self.clock() - self.t0, 6), "seq": self._seq}

    def _durable(self, op: Any, *, publishes: bool = False) -> Future[Any]:
        """Queue ``op`` for the next group commit; remember its future for the transport."""
        assert self.store is not None
        fut = self.store.submit(op, counters=self.counters(), publishes=publishes)
        fut.add_done_callback(self._check_store)
        self.last_durable = fut
        return fut

    def _check_store(self, fut: Future[Any]) -> None:
        exc = fut.exception()
        if exc is not None and self.store_error is None:
            self.store_error = exc
            log.critical("the durable state could not be written (%s); updates are refused "
                         "from now on: free disk space and restart the server", exc)

    def replay(self, pending: list[PendingUpdate]) -> int:
        """Hand the updates acknowledged and not yet published back to the policy, in their
        original order, so the buffer is as it was. Returns how many were replayed."""
        assert self.store is not None
        n = 0
        for p in pending:
            header = UpdateHeader(**{**p.header,
                                     "signature": bytes.fromhex(p.header.get("signature", ""))})
            try:
                payload = self.store.read_payload(p.ref)
                decoded = self.decoder.decode(header.codec, payload,
                                              reference=self.reference_for(header))
            except Exception as exc:  # noqa: BLE001 - decoded once already: a damaged spool
                log.error("pending update %s of %s cannot be replayed and is lost: %s",
                          header.update_id, p.client_id, exc)
                continue
            self._batch.append(p.seq)
            decoded.base_version = header.base_version
            decoded.examples = float(header.num_examples)
            self.policy.restore(p.client_id, header, decoded, p.staleness)
            n += 1
        return n

    def close(self) -> None:
        """Write the final counters and close the durable state (if any)."""
        if self.store is not None:
            try:
                self.store.submit(Touch(), counters=self.counters()).result(30)
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.warning("could not write the final counters: %s", exc)
            self.store.close()

    # -- helpers ------------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs after every state change a waiting client may care about."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        for fn in self._listeners:
            fn()

    def task_signature(self) -> tuple[Any, ...]:
        """What a waiting client's task answer depends on: while it is unchanged, a client
        told to wait would be told to wait again. A held GetTask poll (and a simulated one)
        asks again only when it changes: the version (and whether one is installed), the end of
        the run, a version being published, the policy's round and whether it is open, the
        sessions while no round is open (joins may open one), and a policy's own
        ``task_epoch`` (secure aggregation's stages)."""
        policy = self.policy
        is_open = getattr(policy, "open", None)
        return (self.version, self.ready, self.done, self.publishing,
                getattr(policy, "round", 0), is_open, len(self.sessions) if not is_open else -1,
                getattr(policy, "task_epoch", 0))

    def derive_seed(self, *parts: object) -> int:
        """A 63-bit seed from the run seed and ``parts``; stable across processes and runs."""
        text = "/".join(str(p) for p in (self.config.seed, *parts))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def log_event(self, event: str, **fields: Any) -> None:
        log.debug("%s %s", event, fields)

    @property
    def finished(self) -> bool:
        """No more updates are taken: the run is over, or its last version is being made."""
        return self.done or (self.forward is None
                             and self.version + self.publishing >= self.config.max_versions)

    def _finished_message(self) -> str:
        if self.done:
            return f"the run finished at version {self.version}; no more updates are taken"
        return (f"the run's last version ({self.config.max_versions}) is being published; no "
                f"more updates are taken")

    @property
    def takes_partials(self) -> bool:
        """Whether a leaf's partial aggregate can enter this aggregator's rule."""
        return bool(getattr(self.policy.aggregator, "decomposable", False))

    # -- requests -----------------------------------------------------------------------------

    def client_for(self, session: str) -> ClientRecord:
        """The session's client (now seen), or the refusal a transport answers with."""
        return self._checked(self._record, session)  # type: ignore[no-any-return]

    def task(self, session: str) -> Task:
        rec = self._checked(self._record, session)
        return self.policy.task_for(rec)

    def _checked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, counting a refusal by its status."""
        try:
            return fn(*args)
        except ServiceError as exc:
            self.count_refusal(exc)
            raise

    def tick(self) -> None:
        """Enforce deadlines and expire idle sessions; the transport calls this periodically."""
        now = self.clock()
        before = self.task_signature()
        self.expire_sessions(now)
        for memory in (self._seen, self._counted, self._left):
            memory.expire(now)
        if self._lost:
            self._end_lost(now)
        self.policy.tick(now)
        if self.task_signature() != before:  # a deadline closed or opened a round
            self._changed()
        if self.store is not None and self.store_error is None:
            # Downloads and refusals commit nothing themselves: write the counters now and
            # then, so a crash loses at most a few seconds of them.
            wall = time.monotonic()
            snapshot = (self.traffic.bytes_up, self.traffic.bytes_down,
                        sum(self.traffic.refused.values()))
            if wall - self._counters_at >= COUNTERS_EVERY_S and snapshot != self._counters_seen:
                self._counters_at, self._counters_seen = wall, snapshot
                self.store.submit(Touch(), counters=self.counters())

    def add_download(self, nbytes: int) -> None:
        self.traffic.bytes_down += nbytes

    def stop(self) -> None:
        """Tell every client to stop at its next request."""
        self.done = True
        self._changed()

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "clients": len(self.sessions), "done": self.done,
                "buffered": self.policy.buffered(), "updates": self.traffic.updates,
                "publishing": self.publishing, "refused": dict(self.traffic.refused)}


def _call_now(fn: Callable[[], object]) -> None:
    fn()


__all__ = ["AGG_PREFIX", "CHALLENGE_TTL_S", "LOST_GRACE_S", "MAX_CHALLENGES", "MAX_PARTIAL_COUNT",
           "NONCE_BYTES", "REFERENCE_VERSIONS", "VERSIONS_DIR", "Action", "AggregatorCore",
           "ClientRecord", "Evaluator", "evaluator_for", "link_current"]
