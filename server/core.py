"""The aggregator's domain logic, independent of any transport.

The gRPC servicer and the simulation's in-memory transport both drive this class: it validates
every request, keeps the client registry, hands each decoded update to the round policy as it
arrives, and publishes new global versions (optimizer step, evaluation, metrics, checkpoint).
It is not thread-safe: drive it from one thread or one event loop.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from murmura.aggregation import create_optimizer
from murmura.protocols import (
    PROTOCOL_VERSION,
    Action,
    CodecError,
    DeviceProfile,
    FlatVector,
    JoinResult,
    ModelSpec,
    PushResult,
    Task,
    UnknownCodecError,
    UpdateHeader,
    create_codec,
)
from murmura.protocols.codecs import Codec
from murmura.protocols.codecs.seed import SeedCodec
from murmura.protocols.pool import seed_pool_for
from murmura.server.checkpoint import Checkpoint, save_checkpoint
from murmura.server.config import ServerConfig
from murmura.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from murmura.server.outputs import RunRecorder
from murmura.server.policy import AsyncPolicy, Policy, SyncPolicy
from murmura.server.pool import PoolState

log = logging.getLogger(__name__)

Evaluator = Callable[[FlatVector], dict[str, float]]
MAX_ID_LENGTH = 128
SEEN_UPDATES = 100_000
REFERENCE_VERSIONS = 3


@dataclass
class ClientRecord:
    session: str
    client_id: str
    profile: DeviceProfile
    joined_at: float
    updates: int = 0


@dataclass
class Traffic:
    bytes_up: int = 0
    bytes_down: int = 0
    updates: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class AggregatorCore:
    """Validates requests and turns updates into global versions under a policy."""

    def __init__(self, config: ServerConfig, spec: ModelSpec, initial: FlatVector, *,
                 evaluator: Evaluator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 recorder: RunRecorder | None = None,
                 checkpoint_path: str | Path | None = None,
                 start: Checkpoint | None = None) -> None:
        spec.check_vector(initial)
        self.config = config
        self.spec = spec
        self.fingerprint = spec.fingerprint()
        self.clock = clock
        self.evaluator = evaluator
        self.recorder = recorder
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.optimizer = create_optimizer(config.optimizer, lr=config.server_lr)
        self.version = 0
        self.params: FlatVector = np.array(initial, dtype=np.float32, copy=True)
        if start is not None:
            if start.spec_fingerprint != self.fingerprint:
                raise ValueError(f"checkpoint is for model spec {start.spec_fingerprint}, "
                                 f"this server's spec is {self.fingerprint}")
            spec.check_vector(start.params)
            self.version, self.params = start.version, start.params.copy()
            self.optimizer.load_state_dict(start.optimizer_state)
        self.pool = self._start_pool(start)
        if self.pool is not None:
            self.params = self.pool.model()
        #: Length of the vectors the policy aggregates: the model, or K pool coordinates.
        self.update_size = len(self.pool) if self.pool is not None else spec.size
        self._history: OrderedDict[int, FlatVector] = OrderedDict({self.version: self.params})
        self.sessions: dict[str, ClientRecord] = {}
        self._session_of: dict[str, str] = {}
        self._left: OrderedDict[str, str] = OrderedDict()
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._codecs: dict[tuple[str, tuple[tuple[str, str], ...]], Codec] = {}
        self.traffic = Traffic()
        self.done = self.version >= config.max_versions
        self.t0 = clock()
        self.last_metrics: dict[str, Any] = {}
        self._listeners: list[Callable[[], None]] = []
        self.policy: Policy = SyncPolicy(self) if config.mode == "sync" else AsyncPolicy(self)

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
        rec = self.sessions.get(session)
        if rec is None:
            if session in self._left:
                raise Unauthenticated(f"session {session[:8]}… of client "
                                      f"{self._left[session]!r} has left; join again")
            raise Unauthenticated("unknown session; call Join first")
        return rec

    def _refuse(self, status: str) -> None:
        self.traffic.refused[status] = self.traffic.refused.get(status, 0) + 1

    # -- requests -----------------------------------------------------------------------------

    def join(self, client_id: str, profile: DeviceProfile, *, token: str = "",
             protocol_version: int = PROTOCOL_VERSION) -> JoinResult:
        if not client_id or len(client_id) > MAX_ID_LENGTH or not client_id.isprintable():
            raise InvalidArgument(f"client_id must be 1..{MAX_ID_LENGTH} printable characters")
        if protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(f"client speaks protocol {protocol_version}; this server "
                                     f"speaks {PROTOCOL_VERSION}")
        if self.config.join_token and not hmac.compare_digest(token.encode(),
                                                              self.config.join_token.encode()):
            raise PermissionDenied("join token is missing or wrong")
        old = self._session_of.get(client_id)
        if old is not None:  # a restarted client takes over its identity
            self.sessions.pop(old, None)
        session = secrets.token_urlsafe(16)  # 128 bits in 22 characters
        self.sessions[session] = ClientRecord(session, client_id, profile, self.clock())
        self._session_of[client_id] = session
        log.info("client %s joined (%s)", client_id, profile.device)
        self._changed()
        return JoinResult(session=session, settings=self.config.train, mode=self.config.mode,
                          max_payload_bytes=self.config.max_payload_bytes)

    def task(self, session: str) -> Task:
        rec = self._record(session)
        return self.policy.task_for(rec)

    def model(self, session: str) -> tuple[int, FlatVector]:
        """The current global version and vector (never modified in place: safe to stream)."""
        self._record(session)
        return self.version, self.params

    def pool_base(self, session: str) -> tuple[int, FlatVector]:
        """The seed pool's base model and the version it was taken at (read-only)."""
        self._record(session)
        pool = self._require_pool()
        return pool.base_version, pool.base

    def pool_scalars(self, session: str) -> tuple[int, int, FlatVector]:
        """``(version, base_version, scalars)``: the K numbers that, replayed on the base with
        ``apply_pool``, give the current global model exactly."""
        self._record(session)
        pool = self._require_pool()
        return self.version, pool.base_version, pool.scalars

    def _require_pool(self) -> PoolState:
        if self.pool is None:
            raise FailedPrecondition("this run has no seed pool (it needs trainer 'zo', codec "
                                     "'seed' and codec option pool=K); pull the model instead")
        return self.pool

    def push(self, header: UpdateHeader, payload: bytes | bytearray | memoryview, *,
             wire_bytes: int = 0) -> PushResult:
        """Validate, decode and hand one update to the policy; refuse with a ServiceError."""
        self.traffic.bytes_up += wire_bytes  # refused updates crossed the wire too
        try:
            return self._push(header, payload)
        except (InvalidArgument, FailedPrecondition, ResourceExhausted, Unauthenticated) as exc:
            self._refuse(exc.status)
            raise

    def precheck(self, header: UpdateHeader) -> ClientRecord:
        """Checks that need only the header, so a transport can refuse before the payload.

        A refusal here is counted in ``traffic.refused`` like one from :meth:`push`.
        """
        try:
            return self._precheck(header)
        except (InvalidArgument, FailedPrecondition, ResourceExhausted, Unauthenticated) as exc:
            self._refuse(exc.status)
            raise

    def _precheck(self, header: UpdateHeader) -> ClientRecord:
        rec = self._record(header.session)
        if not header.update_id or len(header.update_id) > MAX_ID_LENGTH:
            raise InvalidArgument(f"update_id must be 1..{MAX_ID_LENGTH} characters")
        if header.payload_bytes < 0:
            raise InvalidArgument(f"payload_bytes must be >= 0, got {header.payload_bytes}")
        if header.payload_bytes > self.config.max_payload_bytes:
            raise ResourceExhausted(f"payload of {header.payload_bytes} bytes exceeds the limit "
                                    f"of {self.config.max_payload_bytes}")
        if header.num_examples <= 0:
            raise InvalidArgument(f"num_examples must be positive, got {header.num_examples}")
        if header.spec_fingerprint and header.spec_fingerprint != self.fingerprint:
            raise FailedPrecondition(f"update was trained for model spec "
                                     f"{header.spec_fingerprint}; this server's is "
                                     f"{self.fingerprint}")
        if header.base_version > self.version:
            raise InvalidArgument(f"base version {header.base_version} is in the future "
                                  f"(global version is {self.version})")
        if header.base_version < 0:
            raise InvalidArgument(f"base version must be >= 0, got {header.base_version}")
        if (rec.client_id, header.update_id) not in self._seen:
            self.policy.check_staleness(self.version - header.base_version)
        return rec

    def _push(self, header: UpdateHeader, payload: bytes | bytearray | memoryview) -> PushResult:
        key = (self._record(header.session).client_id, header.update_id)
        if key in self._seen:
            return PushResult(duplicate=True, version=self.version, staleness=self._seen[key])
        rec = self._precheck(header)
        if self.done:
            raise FailedPrecondition(f"the run finished at version {self.version}; "
                                     f"no more updates are taken")
        if header.payload_bytes != len(payload):
            raise InvalidArgument(f"header announces {header.payload_bytes} payload bytes, "
                                  f"{len(payload)} arrived")
        staleness = self.version - header.base_version
        update = self._decode(header, payload)
        self.traffic.updates += 1  # counted before the policy may publish a version with it
        try:
            self.policy.accept(rec, header, update, staleness)
        except BaseException:
            self.traffic.updates -= 1
            raise
        self._seen[key] = staleness
        if len(self._seen) > SEEN_UPDATES:
            self._seen.popitem(last=False)
        rec.updates += 1
        self._changed()
        return PushResult(duplicate=False, version=self.version, staleness=staleness)

    def _decode(self, header: UpdateHeader, payload: bytes | bytearray | memoryview) -> FlatVector:
        codec = self._codec(header)
        if self.pool is not None:
            return self._decode_pool(codec, payload)
        reference = None
        if codec.needs_reference:
            reference = self._history.get(header.base_version)
            if reference is None:
                raise FailedPrecondition(f"codec {header.codec!r} needs version "
                                         f"{header.base_version} to decode, which is no longer "
                                         f"kept; train on the current version")
        try:
            update = codec.decode(payload, self.spec.size, reference=reference)
        except CodecError as exc:
            raise InvalidArgument(f"payload does not decode: {exc}") from exc
        if update.shape != (self.spec.size,):
            raise InvalidArgument(f"update has {update.size} values; the model has "
                                  f"{self.spec.size}")
        # NaN and Inf propagate through a sum, so a finite sum proves every value finite in one
        # pass without a mask; only a non-finite sum (or an overflow) needs the exact check.
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.add.reduce(update, dtype=np.float32)
        if not np.isfinite(total):
            finite = np.isfinite(update)
            if not finite.all():
                bad = int(np.flatnonzero(~finite)[0])
                raise InvalidArgument(f"update contains NaN or Inf (first at index {bad})")
        return update

    def _decode_pool(self, codec: Codec, payload: bytes | bytearray | memoryview) -> FlatVector:
        """A pool run's update: the K coefficients its steps applied along the pool seeds."""
        assert self.pool is not None
        if not isinstance(codec, SeedCodec) or not codec.pool_size:
            raise InvalidArgument(f"this run aggregates seed-pool updates (codec 'seed' with "
                                  f"pool={len(self.pool)}); codec {codec.name!r} without the "
                                  f"pool cannot be taken")
        try:
            update = self.pool.contribution(codec.unpack(payload))
        except CodecError as exc:
            raise InvalidArgument(f"payload does not decode: {exc}") from exc
        if not np.isfinite(update).all():
            raise InvalidArgument("the update's pool coefficients overflow float32")
        return update

    def _codec(self, header: UpdateHeader) -> Codec:
        # A client may pick its own codec; options are the server's settings for that codec.
        options = self.config.train.codec_options if header.codec == self.config.train.codec \
            else {}
        key = (header.codec, tuple(sorted(options.items())))
        codec = self._codecs.get(key)
        if codec is None:
            try:
                codec = create_codec(header.codec, options)
            except UnknownCodecError as exc:
                raise InvalidArgument(str(exc)) from exc
            except CodecError as exc:
                raise InvalidArgument(f"codec {header.codec!r} is misconfigured: {exc}") from exc
            self._codecs[key] = codec
        return codec

    def leave(self, session: str) -> None:
        rec = self._record(session)
        del self.sessions[session]
        if self._session_of.get(rec.client_id) == session:
            del self._session_of[rec.client_id]
        self._left[session] = rec.client_id
        if len(self._left) > SEEN_UPDATES:
            self._left.popitem(last=False)
        self.policy.on_leave(rec)
        log.info("client %s left", rec.client_id)
        self._changed()

    def tick(self) -> None:
        """Enforce deadlines; the transport calls this periodically."""
        self.policy.tick(self.clock())

    def add_download(self, nbytes: int) -> None:
        self.traffic.bytes_down += nbytes

    def stop(self) -> None:
        """Tell every client to stop at its next request."""
        self.done = True
        self._changed()

    # -- publishing ---------------------------------------------------------------------------

    def apply(self, delta: FlatVector, *, updates: int, round_id: int = 0) -> None:
        """Make ``delta`` (the aggregate update) the next global version."""
        if self.pool is not None:  # pool coordinates; the config allows only plain fedavg
            try:
                self.params = self.pool.advance(delta, lr=self.config.server_lr)
            except ValueError as exc:
                log.error("aggregate dropped, the global model is unchanged: %s", exc)
                return
        else:
            self.params = self.optimizer.step(self.params, delta)
        self.version += 1
        self._history[self.version] = self.params
        while len(self._history) > REFERENCE_VERSIONS:
            self._history.popitem(last=False)
        row: dict[str, Any] = {
            "version": self.version,
            "round": round_id,
            "time_s": round(self.clock() - self.t0, 6),
            "updates": self.traffic.updates,
            "updates_in_version": updates,
            "bytes_up": self.traffic.bytes_up,
            "bytes_down": self.traffic.bytes_down,
            "clients": len(self.sessions),
        }
        if self.evaluator is not None:
            row.update(self.evaluator(self.params))
        self.last_metrics = row
        if self.recorder is not None:
            self.recorder.record(row)
        if self.checkpoint_path is not None:
            save_checkpoint(self.checkpoint_path, Checkpoint(
                version=self.version, params=self.params, spec_fingerprint=self.fingerprint,
                optimizer_state=self.optimizer.state_dict(),
                meta={"mode": self.config.mode, "updates": self.traffic.updates,
                      **({"pool": {"k": len(self.pool), "base_seed": self.pool.pool.base_seed}}
                         if self.pool is not None else {})},
                extra=self.pool.arrays() if self.pool is not None else {}))
        if self.version >= self.config.max_versions:
            self.done = True
        log.info("version %d: %s", self.version,
                 ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items() if k != "version"))
        self._changed()

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "clients": len(self.sessions), "done": self.done,
                "buffered": self.policy.buffered(), "updates": self.traffic.updates,
                "refused": dict(self.traffic.refused)}


def evaluator_for(model_factory: Callable[[], Any], spec: ModelSpec, data: Any) -> Evaluator:
    """An evaluator that loads the global vector into one model and measures it on ``data``."""
    from murmura.tasks import evaluate

    model = model_factory()

    def run(params: FlatVector) -> dict[str, float]:
        spec.load_into(model, params)
        return evaluate(model, data)

    return run


__all__ = ["Action", "AggregatorCore", "ClientRecord", "Evaluator", "evaluator_for"]
