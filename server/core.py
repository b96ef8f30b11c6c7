"""The aggregator's domain logic, independent of any transport.

The gRPC servicer and the simulation's in-memory transport both drive this class: it validates
every request, keeps the client registry, hands each decoded update to the round policy as it
arrives, and publishes new global versions (optimizer step, evaluation, metrics, checkpoint).
It is not thread-safe: drive it from one thread or one event loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
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
    PROTOCOL_VERSION,
    Action,
    DeviceProfile,
    FlatVector,
    JoinProof,
    JoinResult,
    ModelSpec,
    PushResult,
    Task,
    UpdateHeader,
)
from murmura.protocols.codecs import one_torch_thread
from murmura.protocols.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    IdentityError,
    check_public_key,
    client_id_for,
    join_message,
    load_public_keys,
    signed_update_message,
    verify,
)
from murmura.protocols.pool import seed_pool_for
from murmura.server.checkpoint import Checkpoint, save_checkpoint
from murmura.server.client_eval import ClientEvals, report_from_metrics
from murmura.server.config import ServerConfig
from murmura.server.decoding import PARTIAL_CODEC, Decoded, Decoder, check_range
from murmura.server.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from murmura.server.limits import (
    MAX_ID,
    MAX_NUM_EXAMPLES,
    MAX_TOKEN,
    check_header,
    check_profile,
    check_session,
    check_text,
    quote,
)
from murmura.server.model import ModelRule, OptimizerRule, PoolRule
from murmura.server.outputs import RunRecorder, clean_row
from murmura.server.policy import AsyncPolicy, CompassPolicy, Policy, PolicyHost, SyncPolicy
from murmura.server.pool import PoolState
from murmura.server.publisher import Publisher
from murmura.server.ratelimit import RateLimiter
from murmura.server.recent import RecentMap
from murmura.server.state import (
    AggregatorState,
    Consume,
    DropPush,
    EndSession,
    PendingUpdate,
    PublishVersion,
    RecordPush,
    SaveSession,
    SpoolRef,
    StoredState,
    Touch,
)
from murmura.server.store import fsync_dir

if TYPE_CHECKING:
    from murmura.server.pipeline import PushPipeline

log = logging.getLogger(__name__)

Evaluator = Callable[[FlatVector], dict[str, float]]
SEEN_UPDATES = 100_000
JOIN_BURST = 10
PUSH_BURST = 50
#: What one version's aggregate may hold, as a sum over its updates of max |value| x weight:
#: below float32's 3.4e38 with headroom, or the exact accumulator's range (sum of max
#: |contribution| < 2**42, see aggregation/partial.py). Bounding the sum before each fold proves
#: that no fold overflows, whatever the rule does with weights <= 1 (staleness factors are).
FOLD_LIMIT = {"float32": 1e38, "exact": 0.99 * 2.0**42}
REFERENCE_VERSIONS = 3
#: The most client updates one partial aggregate may stand for.
MAX_PARTIAL_COUNT = 1 << 31
#: Join challenges: how long a nonce stays valid, and how many may be outstanding (the oldest
#: gives way to a new one, so a flood of Challenge calls cannot grow memory).
CHALLENGE_TTL_S = 60.0
MAX_CHALLENGES = 10_000
NONCE_BYTES = 32
#: Versioned checkpoints of a durable run, under the output directory; the state database
#: names the current one, and ``checkpoint.npz`` is linked to it.
VERSIONS_DIR = "checkpoints"
#: Prefix of the aggregation rule's state arrays in a checkpoint (robust and Sybil rules).
AGG_PREFIX = "agg."
#: How often (seconds) the tick writes counters that changed without a commit (downloads).
COUNTERS_EVERY_S = 2.0
#: A client whose waiting call was cancelled from its side (its process exited, its
#: connection broke) and that makes no call within this many seconds has gone: its session
#: ends. A live client retries a failed call sooner (its backoff starts at 0.2 s).
LOST_GRACE_S = 1.0


@dataclass
class ClientRecord:
    session: str
    client_id: str
    profile: DeviceProfile
    joined_at: float
    updates: int = 0
    last_seen: float = 0.0
    #: The Ed25519 key the client proved at Join (empty when the server takes no identities).
    public_key: bytes = b""


@dataclass
class Traffic:
    bytes_up: int = 0
    bytes_down: int = 0
    updates: int = 0
    refused: dict[str, int] = field(default_factory=dict)


#: Forwards a leaf's partial aggregate upstream: ``forward(aggregator, updates)`` runs on the
#: publisher thread, takes the aggregator's partial and resets it.
Forward = Callable[[Aggregator, int], None]


class AggregatorCore:
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
        optimizer = create_optimizer(config.optimizer, lr=config.server_lr)
        if start is not None:
            if start.spec_fingerprint != self.fingerprint:
                raise ValueError(f"checkpoint is for model spec {start.spec_fingerprint}, "
                                 f"this server's spec is {self.fingerprint}")
            spec.check_vector(start.params)
            self.version, self.params = start.version, start.params.copy()
            optimizer.load_state_dict(start.optimizer_state)
        self.decoder = Decoder(spec.size, config.train, hash_payloads=config.require_identity)
        #: Public keys allowed to join (None: any key that proves itself).
        self.allowed_keys = load_public_keys(config.allowed_keys) if config.allowed_keys else None
        #: Public keys of the leaf aggregators that may push partial aggregates.
        self.leaf_keys = load_public_keys(config.leaf_keys) if config.leaf_keys else frozenset()
        self._challenges: OrderedDict[bytes, float] = OrderedDict()
        #: SHA-256 of counted payloads -> the client they were counted from (bounded in
        #: entries and age, like the other memories of past requests below).
        self._counted: RecentMap[bytes, str] = RecentMap(SEEN_UPDATES, config.dedup_ttl_s, clock)
        pool = self._start_pool(start)
        #: The FedKSeed state in a seed-pool run (see server/pool.py), else None.
        self.pool = pool
        self.rule: ModelRule = (PoolRule(pool, lr=config.server_lr) if pool is not None
                                else OptimizerRule(optimizer))
        if pool is not None:
            self.params = pool.model()
            self._pool_scalars = pool.scalars
        #: Length of the vectors the policy aggregates: the model, or K pool coordinates.
        self.update_size = self.decoder.update_size
        self._history: OrderedDict[int, FlatVector] = OrderedDict({self.version: self.params})
        self.sessions: dict[str, ClientRecord] = {}
        self._session_of: dict[str, str] = {}
        self._left: RecentMap[str, str] = RecentMap(SEEN_UPDATES, config.dedup_ttl_s, clock)
        #: Sessions from least to most recently used, for expiry.
        self._last_seen: OrderedDict[str, float] = OrderedDict()
        #: Sessions whose waiting call was cancelled by the client's side, and when.
        self._lost: dict[str, float] = {}
        self._join_limit = RateLimiter(config.join_per_s, JOIN_BURST)
        self._push_limit = RateLimiter(config.push_per_s, PUSH_BURST)
        #: Counted (client id, update id) -> staleness: a retried push is answered as a
        #: duplicate for as long as a client may retry it.
        self._seen: RecentMap[tuple[str, str], int] = RecentMap(SEEN_UPDATES,
                                                                config.dedup_ttl_s, clock)
        self._inflight: set[tuple[str, str]] = set()
        self._valid_header: UpdateHeader | None = None  # the last header check_header passed
        self.traffic = Traffic()
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
        self._pub_params = self.params        # the publisher thread's view of the model
        self._pub_version = self.version
        #: Set on a leaf aggregator: publishing forwards the partial upstream instead.
        self.forward: Forward | None = None
        #: False while a leaf waits for its parent's first model: clients are told to wait.
        self.ready = True
        #: Sum of max |value| x weight of the updates folded since the last publish; an update
        #: that would take it past ``fold_limit`` is refused (see FOLD_LIMIT).
        self.fold_mass = 0.0
        self.fold_limit = FOLD_LIMIT[config.accumulator]
        #: Extra figures for the metrics row (the serverless tier's workers and queue).
        self.row_extras: Callable[[], dict[str, Any]] | None = None
        policies: dict[str, Callable[[PolicyHost], Policy]] = {
            "sync": SyncPolicy, "async": AsyncPolicy, "compass": CompassPolicy}
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

    # -- helpers ------------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs after every state change a waiting client may care about."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        for fn in self._listeners:
            fn()

    def derive_seed(self, *parts: object) -> int:
        """A 63-bit seed from the run seed and ``parts``; stable across processes and runs."""
        text = "/".join(str(p) for p in (self.config.seed, *parts))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def log_event(self, event: str, **fields: Any) -> None:
        log.debug("%s %s", event, fields)

    def active_client_ids(self) -> list[str]:
        return list(self._session_of)

    def _record(self, session: str) -> ClientRecord:
        """The session's client, which is now seen (it expires ``session_ttl_s`` later)."""
        check_session(session)
        rec = self.sessions.get(session)
        if rec is None:
            if session in self._left:
                raise Unauthenticated(f"session {session[:8]}… of client "
                                      f"{quote(self._left[session])} has ended (it left or "
                                      f"expired); join again")
            raise Unauthenticated("unknown session; call Join first")
        rec.last_seen = self.clock()
        self._last_seen.pop(session, None)
        self._last_seen[session] = rec.last_seen
        if self._lost:
            self._lost.pop(session, None)
        return rec

    def record_of(self, client_id: str) -> ClientRecord | None:
        """The open session's record of ``client_id`` (not marked as seen)."""
        session = self._session_of.get(client_id)
        return None if session is None else self.sessions.get(session)

    def drop_client(self, rec: ClientRecord, why: str) -> None:
        """End a client's session without its asking (a policy found it dead): its next call
        is told to join again, so a client that was only slow comes back."""
        if self.sessions.get(rec.session) is not rec:
            return
        self._end_session(rec.session, rec, forget=False)
        log.info("client %s taken for gone: %s; its session ends", rec.client_id, why)
        self._changed()

    def lost_contact(self, session: str) -> None:
        """The transport saw the client's waiting call cancelled from the client's side; unless
        the client calls again within LOST_GRACE_S, its session ends (see :meth:`tick`)."""
        if session in self.sessions:
            self._lost[session] = self.clock()

    def count_refusal(self, refusal: ServiceError | str) -> None:
        """Count one refused request by its status (the metrics rows report the counts); an
        error that was counted already is not counted again."""
        if isinstance(refusal, ServiceError):
            if refusal.counted:
                return
            refusal.counted = True
            refusal = refusal.status
        self.traffic.refused[refusal] = self.traffic.refused.get(refusal, 0) + 1

    def _end_session(self, session: str, rec: ClientRecord, *, forget: bool = True) -> None:
        """``forget``: the client left for good (its measurements go too)."""
        del self.sessions[session]
        self._last_seen.pop(session, None)
        self._lost.pop(session, None)
        if self._session_of.get(rec.client_id) == session:
            del self._session_of[rec.client_id]
        self._left[session] = rec.client_id
        if self.store is not None:
            self._durable(EndSession(session))
        self.policy.on_leave(rec)
        if forget:
            self.policy.forget(rec.client_id)

    def expire_sessions(self, now: float) -> int:
        """End the sessions unused for ``session_ttl_s``; how many ended."""
        ttl = self.config.session_ttl_s
        if not ttl:
            return 0
        ended = 0
        while self._last_seen:
            session, seen = next(iter(self._last_seen.items()))
            if now - seen < ttl:
                break
            self._last_seen.popitem(last=False)
            rec = self.sessions.get(session)
            if rec is not None:
                self._end_session(session, rec)
                log.info("session of client %s expired after %.0f s unused", rec.client_id,
                         now - seen)
                ended += 1
        if ended:
            self._changed()
        return ended

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

    def challenge(self) -> tuple[bytes, float]:
        """A single-use nonce for :meth:`join` and how many seconds it stays valid."""
        now = self.clock()
        while self._challenges and next(iter(self._challenges.values())) <= now:
            self._challenges.popitem(last=False)  # expired
        while len(self._challenges) >= MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._challenges[nonce] = now + CHALLENGE_TTL_S
        return nonce, CHALLENGE_TTL_S

    def join(self, client_id: str, profile: DeviceProfile, *, token: str = "",
             protocol_version: int = PROTOCOL_VERSION, proof: JoinProof | None = None
             ) -> JoinResult:
        """Open a session for ``client_id``. With ``require_identity`` the client must send a
        ``proof`` that it holds the key its id derives from (see protocols/identity.py); a
        Join for an id whose session is open ends that session only if it proves the same key
        (a restarted client), so nobody else can take an identity over."""
        try:
            return self._join(client_id, profile, token, protocol_version, proof)
        except ServiceError as exc:
            self.count_refusal(exc)
            raise

    def _join(self, client_id: str, profile: DeviceProfile, token: str,
              protocol_version: int, proof: JoinProof | None) -> JoinResult:
        check_text("client_id", client_id, MAX_ID)
        check_text("token", token, MAX_TOKEN, allow_empty=True)
        check_profile(profile)
        if protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(f"client speaks protocol {protocol_version}; this server "
                                     f"speaks {PROTOCOL_VERSION}")
        if self.config.join_token and not hmac.compare_digest(token.encode(),
                                                              self.config.join_token.encode()):
            raise PermissionDenied("join token is missing or wrong")
        public_key = b""
        if proof is not None and (proof.public_key or proof.signature or proof.nonce):
            public_key = self._check_proof(client_id, proof)
        elif self.config.require_identity:
            raise Unauthenticated("this server requires a node identity: sign a Challenge nonce "
                                  "with an Ed25519 key (clients make one unless given --key)")
        if profile.device == "leaf" and self.config.require_identity \
                and public_key not in self.leaf_keys:  # refused now, not at its first push
            raise PermissionDenied(
                f"leaf {quote(client_id)} is not registered here: add its key (the .pub of the "
                f"leaf's --key FILE) to this server's --leaf-keys")
        # After the proof: nobody can spend another identity's join budget.
        now = self.clock()
        wait = self._join_limit.allow(client_id, now)
        if wait:
            raise ResourceExhausted(f"client {quote(client_id)} joins too often (at most "
                                    f"{self.config.join_per_s:g} per second)",
                                    retry_after_s=wait)
        old = self._session_of.get(client_id)
        if old is not None:  # a restarted client takes over its identity
            previous = self.sessions.get(old)
            if previous is not None and previous.public_key != public_key:
                raise PermissionDenied(f"client id {client_id[:40]!r} is held by another key")
            self.sessions.pop(old, None)
            self._last_seen.pop(old, None)
        elif len(self.sessions) >= self.config.max_sessions:
            self.expire_sessions(now)
            if len(self.sessions) >= self.config.max_sessions:
                raise ResourceExhausted(f"the server holds its maximum of "
                                        f"{self.config.max_sessions} sessions; try later",
                                        retry_after_s=30.0)
        session = secrets.token_urlsafe(16)  # 128 bits in 22 characters
        self.sessions[session] = ClientRecord(session, client_id, profile, now, last_seen=now,
                                              public_key=public_key)
        self._last_seen[session] = now
        self._session_of[client_id] = session
        self.last_durable = None
        if self.store is not None:
            self._durable(SaveSession(session, client_id, dataclasses.asdict(profile),
                                      time.time(), public_key=public_key, replaces=old))
        log.info("client %s joined (%s)", client_id, profile.device)
        self._changed()
        return JoinResult(session=session, settings=self.config.train, mode=self.config.mode,
                          max_payload_bytes=self.config.max_payload_bytes)

    def _check_proof(self, client_id: str, proof: JoinProof) -> bytes:
        """The proven public key, or a refusal saying which part of the proof is wrong."""
        expires = self._challenges.pop(bytes(proof.nonce), None)  # single use, also on failure
        if len(proof.public_key) != PUBLIC_KEY_BYTES or len(proof.signature) != SIGNATURE_BYTES:
            raise InvalidArgument(f"join proof needs a {PUBLIC_KEY_BYTES}-byte Ed25519 public key "
                                  f"and a {SIGNATURE_BYTES}-byte signature, got "
                                  f"{len(proof.public_key)} and {len(proof.signature)} bytes")
        try:
            check_public_key(proof.public_key)
        except IdentityError as exc:
            raise InvalidArgument(f"join proof: {exc}") from None
        if expires is None or expires < self.clock():
            raise Unauthenticated("the join challenge is unknown, used or expired; ask for a "
                                  "new one")
        expected = client_id_for(proof.public_key)
        if client_id != expected:
            raise PermissionDenied(f"client id {client_id[:40]!r} is not the id of this public "
                                   f"key ({expected}); ids derive from keys")
        if not verify(proof.public_key, proof.signature,
                      join_message(proof.nonce, client_id, proof.public_key)):
            raise Unauthenticated("the join signature does not verify with the given key")
        if self.allowed_keys is not None and proof.public_key not in self.allowed_keys:
            raise PermissionDenied(f"key of {client_id} is not on this server's allow-list")
        return bytes(proof.public_key)

    def _check_leaf(self, rec: ClientRecord) -> None:
        """Only a registered leaf aggregator may push a partial aggregate: its count and weight
        stand for many clients, so from anyone else one push could fill a buffer alone."""
        if not self.takes_partials:
            raise FailedPrecondition(
                f"this aggregator's rule {self.config.defense!r} needs every update, so a "
                f"leaf's partial aggregate cannot enter it; use a decomposable rule (fedavg) "
                f"or connect the clients directly")
        if self.config.require_identity and rec.public_key not in self.leaf_keys:
            raise PermissionDenied(
                f"only registered leaf aggregators may push partial aggregates, and the key of "
                f"{quote(rec.client_id)} is not in this server's --leaf-keys (start the leaf "
                f"with --key FILE and add FILE.pub to the parent's --leaf-keys)")

    @staticmethod
    def _check_partial(decoded: Decoded) -> None:
        """A partial's count and weight must be those of real updates: each counts once and
        weighs its example count (an integer from 1 to MAX_NUM_EXAMPLES), so its step, sum
        over weight, is bounded like one update's (a tiny weight would escape the fold bound)."""
        count, weight = int(decoded.count), float(decoded.weight or 0.0)
        if not 1 <= count <= MAX_PARTIAL_COUNT:
            raise InvalidArgument(f"a partial aggregate's count must lie in [1, "
                                  f"{MAX_PARTIAL_COUNT}], got {count}")
        if not count <= weight <= count * MAX_NUM_EXAMPLES:
            raise InvalidArgument(f"a partial aggregate of {count} updates must weigh between "
                                  f"{count} and {count} x {MAX_NUM_EXAMPLES} (one example count "
                                  f"each), got {weight:.6g}")

    def _check_signature(self, rec: ClientRecord, header: UpdateHeader,
                         digest: bytes | None) -> None:
        """Refuse an update its session's key did not sign, or a payload already counted
        from another client (a captured update re-signed by a second identity)."""
        if digest is None or not rec.public_key:
            raise FailedPrecondition("this update cannot be checked: its session has no key")
        if not verify(rec.public_key, header.signature, signed_update_message(header, digest)):
            raise PermissionDenied("the update's signature does not verify with this session's "
                                   "key (modified, replayed from another session, or forged)")
        owner = self._counted.get(digest)
        if owner is not None and owner != rec.client_id:
            raise PermissionDenied("this payload was already counted from another client; a "
                                   "copied update is refused")

    def task(self, session: str) -> Task:
        rec = self._checked(self._record, session)
        return self.policy.task_for(rec)

    def model(self, session: str) -> tuple[int, FlatVector]:
        """The current global version and vector (never modified in place: safe to stream)."""
        self._checked(self._record, session)
        return self.version, self.params

    def _checked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, counting a refusal by its status."""
        try:
            return fn(*args)
        except ServiceError as exc:
            self.count_refusal(exc)
            raise

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

    def push(self, header: UpdateHeader, payload: bytes | memoryview, *,
             wire_bytes: int = 0) -> PushResult:
        """One update through the push pipeline on this thread, with the in-process tier
        (:meth:`murmura.server.pipeline.PushPipeline.push`); refuses with a ServiceError."""
        return self.pipeline.push(header, payload, wire_bytes=wire_bytes)

    @property
    def pipeline(self) -> PushPipeline:
        """The push pipeline of callers without a server of their own (the simulator, the
        in-memory transport, tests): the steps every push takes, decoding in-process."""
        if self._pipeline is None:
            from murmura.server.pipeline import PushPipeline
            from murmura.server.tier import Tier

            self._pipeline = PushPipeline(self, Tier(self.config, self.decoder))
        return self._pipeline

    def precheck(self, header: UpdateHeader) -> ClientRecord:
        """Checks that need only the header, so a transport can refuse before the payload.

        A refusal here is counted in ``traffic.refused`` like one from :meth:`push`.
        """
        try:
            return self._precheck(header)
        except ServiceError as exc:
            self.count_refusal(exc)
            raise

    def _precheck(self, header: UpdateHeader, rec: ClientRecord | None = None) -> ClientRecord:
        # A transport prechecks a header and then pushes that same (frozen) header object:
        # its fields are validated once (a tenth of a simulated round went to validating
        # each header twice). A header that is not the last one validated is checked again.
        if header is not self._valid_header:
            check_header(header)
            self._valid_header = header
        if rec is None:
            rec = self._record(header.session)
        if header.payload_bytes > self.config.max_payload_bytes:
            raise ResourceExhausted(f"payload of {header.payload_bytes} bytes exceeds the limit "
                                    f"of {self.config.max_payload_bytes}")
        if self.config.require_identity and len(header.signature) != SIGNATURE_BYTES:
            if not header.signature:
                raise PermissionDenied("this server counts only signed updates; the update has "
                                       "no signature")
            raise InvalidArgument(f"an update signature has {SIGNATURE_BYTES} bytes, got "
                                  f"{len(header.signature)}")
        if header.spec_fingerprint != self.fingerprint:
            # No retry can fix this: the session ends with the refusal, so a sync round does
            # not wait for a client that will never send an update it can take.
            self._end_session(rec.session, rec)
            self._changed()
            raise FailedPrecondition(f"update was trained for model spec "
                                     f"{quote(header.spec_fingerprint)}; this server's is "
                                     f"{self.fingerprint}; the session is closed")
        if header.base_version > self.version:
            raise InvalidArgument(f"base version {header.base_version} is in the future "
                                  f"(global version is {self.version})")
        if header.codec == PARTIAL_CODEC:
            self._check_leaf(rec)
        if (rec.client_id, header.update_id) not in self._seen:
            self.policy.check_staleness(self.version - header.base_version)
        return rec

    def begin_push(self, header: UpdateHeader, payload_bytes: int, *, wire_bytes: int = 0
                   ) -> tuple[ClientRecord, PushResult | None]:
        """Everything checkable before decoding. Returns the client's record and, for a retried
        update that was already counted, the answer to give (the payload need not be decoded).

        Unless it refuses or answers a duplicate, the caller must end the push with
        :meth:`finish_push` or :meth:`abort_push`.
        """
        self.traffic.bytes_up += wire_bytes  # refused updates crossed the wire too
        try:
            if self.store_error is not None:
                raise Unavailable("the aggregator cannot write its durable state; retry later")
            rec = self._record(header.session)
            wait = self._push_limit.allow(rec.client_id, self.clock())
            if wait:
                raise ResourceExhausted(f"client {quote(rec.client_id)} pushes too often (at "
                                        f"most {self.config.push_per_s:g} per second)",
                                        retry_after_s=wait)
            key = (rec.client_id, header.update_id)
            if key in self._seen:
                # A retry while the first push still waits for its commit: the duplicate is
                # answered once the update is durable too (the transport awaits this).
                self.last_durable = self._committing.get(key)
                return rec, PushResult(duplicate=True, version=self.version,
                                       staleness=self._seen[key])
            if key in self._inflight:
                raise Aborted(f"update {header.update_id!r} is already being taken in; retry "
                              f"to learn its outcome")
            rec = self._precheck(header, rec)
            if self.finished:
                raise FailedPrecondition(self._finished_message())
            if header.payload_bytes != payload_bytes:
                raise InvalidArgument(f"header announces {header.payload_bytes} payload bytes, "
                                      f"{payload_bytes} arrived")
        except ServiceError as exc:
            self.count_refusal(exc)
            raise
        self._inflight.add(key)
        return rec, None

    def reference_for(self, header: UpdateHeader) -> FlatVector | None:
        """The version a reference-needing codec (seed replay) decodes against, if kept."""
        if not self.decoder.needs_reference(header.codec):
            return None
        return self._history.get(header.base_version)

    def abort_push(self, header: UpdateHeader, exc: BaseException) -> None:
        """Decoding failed: count the refusal and forget the update (a retry may come)."""
        self._inflight.discard(self._key(header))
        if isinstance(exc, ServiceError):
            self.count_refusal(exc)

    def _key(self, header: UpdateHeader) -> tuple[str, str]:
        rec = self.sessions.get(header.session)
        return (rec.client_id if rec else "", header.update_id)

    def finish_push(self, header: UpdateHeader, decoded: Decoded, *,
                    release: Callable[[], None] | None = None,
                    spooled: SpoolRef | None = None,
                    rec: ClientRecord | None = None) -> PushResult:
        """Hand a decoded update to the policy. ``release`` is called once nothing needs the
        decoded values any more (after the fold), also when the update is refused.

        With durable state, ``spooled`` is where the payload lies in the spool; the update is
        acknowledged only once :attr:`last_durable` is done (its pending row and counted id
        are committed before any version that includes it: the store runs in order).
        ``rec`` is the client's record when the caller found it with nothing run since
        (:meth:`push`); otherwise it is looked up again.
        """
        key = self._key(header) if rec is None else (rec.client_id, header.update_id)
        self._inflight.discard(key)
        digest = decoded.payload_sha256
        self.last_durable = None
        taken = False
        try:
            if rec is None:  # decoded elsewhere: the client may have left meanwhile
                rec = self._record(header.session)
            if self.config.require_identity:
                self._check_signature(rec, header, digest)
            if self.finished:
                raise FailedPrecondition(self._finished_message())
            staleness = self.version - header.base_version  # versions may have been published
            self.policy.check_staleness(staleness)
            if decoded.is_partial:
                self._check_partial(decoded)
            mass = decoded.max_abs * (1.0 if decoded.is_partial else float(header.num_examples))
            if self.fold_mass + mass > self.fold_limit:
                raise InvalidArgument(
                    f"update too large to aggregate: max |value| x num_examples = {mass:.3g} "
                    f"would take this version's aggregate past {self.fold_limit:.3g} (its "
                    f"range, with {self.fold_mass:.3g} already taken)")
            if self.store is not None and spooled is None:
                raise Unavailable("the update's payload was not spooled; retry")
            # counted before the policy may publish a version with it (which resets the mass)
            self.traffic.updates += 1
            self.fold_mass += mass
            seq = 0
            if self.store is not None:
                assert spooled is not None
                self._seq += 1
                seq = self._seq
                self._batch.append(seq)  # before accept: it may publish the version with it
                fut = self._durable(RecordPush(seq, rec.client_id, header.update_id,
                                               _header_record(header), staleness, spooled))
                self._committing[key] = fut
                fut.add_done_callback(lambda _: self._committing.pop(key, None))
            report = report_from_metrics(rec.client_id, header.metrics)
            if report is not None:  # before accept: it may publish the version with it
                self.client_evals.add(report)
            try:
                self.policy.accept(rec, header, decoded, staleness, release)
                taken = True
            except BaseException:
                if report is not None:
                    self.client_evals.discard(report)
                self.traffic.updates -= 1
                self.fold_mass -= mass
                if seq:
                    self._batch.remove(seq)
                    self._committing.pop(key, None)
                    self._durable(DropPush(seq, rec.client_id, header.update_id))
                    self.last_durable = None
                raise
        except ServiceError as exc:
            self.count_refusal(exc)
            raise
        finally:
            if not taken and release is not None:
                release()
        self._seen[key] = staleness
        if digest is not None:
            self._counted[digest] = rec.client_id
        rec.updates += 1
        self._changed()
        return PushResult(duplicate=False, version=self.version, staleness=staleness)

    def _end_lost(self, now: float) -> None:
        gone = [(s, t) for s, t in self._lost.items() if now - t >= LOST_GRACE_S]
        for session, since in gone:
            self._lost.pop(session, None)
            rec = self.sessions.get(session)
            if rec is not None:
                self.drop_client(rec, f"its waiting call was cancelled from its side and it "
                                      f"has not called since ({now - since:.1f} s)")

    def leave(self, session: str) -> None:
        rec = self._checked(self._record, session)
        self._end_session(session, rec)
        log.info("client %s left", rec.client_id)
        self._changed()

    def tick(self) -> None:
        """Enforce deadlines and expire idle sessions; the transport calls this periodically."""
        now = self.clock()
        self.expire_sessions(now)
        for memory in (self._seen, self._counted, self._left):
            memory.expire(now)
        if self._lost:
            self._end_lost(now)
        self.policy.tick(now)
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

    # -- folding and publishing ---------------------------------------------------------------

    def fold(self, fn: Callable[..., None], decoded: Decoded, *args: Any,
             release: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """Run ``fn(decoded, *args, **kwargs)`` (an accumulator update) on the publisher, after
        the jobs before it; then ``release``, with no reference to ``decoded`` left here (a
        receive buffer is reused only when nothing else holds it)."""
        box = [decoded]

        def run() -> None:
            try:
                with one_torch_thread(self.update_size):  # a memory-bound fold: one core
                    fn(box.pop(), *args, **kwargs)
            finally:
                if release is not None:
                    release()
        # Decoded updates are checked before they are folded, so an error here is a bug,
        # not bad input: it is logged and the update is not in the aggregate.
        self.publisher.post(run, what="folding an update (it is not in the aggregate)")

    def publish(self, aggregator: Aggregator, *, updates: int, round_id: int = 0) -> None:
        """Make what ``aggregator`` holds the next global version (a leaf: send it upstream).

        Called by the policy on the owner's thread. The aggregate, the optimizer step,
        evaluation, the metrics row and the checkpoint run on the publisher after every fold
        submitted before; the new version is installed on the owner's thread when they are done.
        """
        self.publishing += 1
        self.fold_mass = 0.0  # later folds go into the next aggregate (the publisher is FIFO)
        if self.forward is not None:
            forward = self.forward
            self.client_evals.flush()  # a leaf writes no rows; its parent's clients report
            self.publisher.submit(lambda: forward(aggregator, updates))
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
        }
        row.update(self.client_evals.flush())
        if self.row_extras is not None:
            row.update(self.row_extras())
        seqs, self._batch = self._batch, []
        fut = self.publisher.submit(lambda: self._make_version(aggregator, row, seqs))
        fut.add_done_callback(lambda f: self.post(lambda: self._install(f)))
        self.publishes += 1
        self.last_publish = fut

    def _make_version(self, aggregator: Aggregator, row: dict[str, Any],
                      seqs: list[int] | None = None) -> tuple[FlatVector, dict[str, Any], Any]:
        """On the publisher thread: aggregate, step, evaluate, record, checkpoint."""
        t0 = time.perf_counter()
        try:
            try:
                delta = aggregator.result()
            finally:
                aggregator.reset()
            with np.errstate(over="ignore", invalid="ignore"):  # checked just below
                params = self.rule.advance(self._pub_params, delta)  # ValueError: dropped
            try:
                check_range(params, "the new global model")
            except ServiceError as exc:  # e.g. a server optimizer's step overflowed
                raise ValueError(f"{exc.message}; the version is dropped") from None
        except ValueError:
            if self.store is not None and seqs:  # its updates are spent: never replay them
                self.store.submit(Consume(tuple(seqs)), publishes=True)
            raise
        t1 = time.perf_counter()
        self._pub_params = params
        self._pub_version += 1
        row = {"version": self._pub_version, **row, "aggregate_s": round(t1 - t0, 6)}
        if self.evaluator is not None:
            row.update(self.evaluator(params))
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

    def _checkpoint(self, params: FlatVector, aggregator: Aggregator, row: dict[str, Any]
                    ) -> Checkpoint:
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
        except Exception as exc:
            log.error("aggregate dropped, the global model is unchanged: %s", exc,
                      exc_info=not isinstance(exc, ValueError))
            self._changed()
            return
        self.install(row["version"], params, row=row, pool_scalars=scalars)

    def install(self, version: int, params: FlatVector, *, row: dict[str, Any] | None = None,
                pool_scalars: FlatVector | None = None) -> None:
        """Make ``params`` global version ``version`` (a leaf: the version its parent sent)."""
        self.version = version
        self.params = params
        self.ready = True
        if self.forward is not None:
            self.publishing = 0
            self._pub_params, self._pub_version = params, version
        if pool_scalars is not None:
            self._pool_scalars = pool_scalars
        self._history[version] = params
        while len(self._history) > REFERENCE_VERSIONS:
            self._history.popitem(last=False)
        if row is not None:
            self.last_metrics = row
            log.info("version %d: %s", version,
                     ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items() if k != "version"))
        if self.forward is None and self.version >= self.config.max_versions:
            self.done = True
        self._changed()

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "clients": len(self.sessions), "done": self.done,
                "buffered": self.policy.buffered(), "updates": self.traffic.updates,
                "publishing": self.publishing, "refused": dict(self.traffic.refused)}


def _header_record(header: UpdateHeader) -> dict[str, Any]:
    """The header as JSON-ready fields (the signature as hex) for the pending-updates table."""
    record = dataclasses.asdict(header)
    record["signature"] = header.signature.hex()
    return record


def _call_now(fn: Callable[[], object]) -> None:
    fn()


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


__all__ = ["Action", "AggregatorCore", "ClientRecord", "Evaluator", "evaluator_for"]
