"""The client loop: join, ask for a task, pull, train, encode, push, repeat.

It survives the server going away: retryable failures back off as
:class:`~murmura.client.retry.RetryPolicy` says (exponential, seeded jitter, at least the
server's retry hint) and resume when the server is back; a lost session (server restarted)
re-joins; a retried push keeps its update id, so the server counts it once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from murmura.client.retry import RetryPolicy, jitter_rng
from murmura.client.rules import (
    UpdateIds,
    after_refusal,
    auto_switch,
    codec_choice,
    encoder_seed,
    make_encoder,
    run_is_over,
)
from murmura.client.secagg import SecAggClient, SecAggRefused, StepHook, run_round
from murmura.client.trainer import Trainer, delta_of
from murmura.client.transport import RemoteError, Transport
from murmura.protocols import (
    Action,
    DeviceProfile,
    Encoder,
    FlatVector,
    ModelSpec,
    PushResult,
    TaskSettings,
    UpdateHeader,
    create_codec,
)
from murmura.protocols.codecs.seed import SeedPool, pool_model
from murmura.protocols.identity import NodeKey, payload_digest
from murmura.protocols.pool import seed_pool_for
from murmura.protocols.secagg.weighted import SecAggParams

log = logging.getLogger(__name__)
T = TypeVar("T")

UpdateHook = Callable[[FlatVector], FlatVector]


@dataclass(frozen=True)
class TaskReport:
    """One finished task, for a caller that shows progress (``murmura client``): the version
    trained on, the examples seen, the local metrics, and what the server did with the push
    (``pushed``; else ``refused`` holds the refusal's status)."""

    version: int
    examples: int
    metrics: dict[str, float]
    pushed: bool
    refused: str = ""
    staleness: int = 0
    duplicate: bool = False


@dataclass
class ClientStats:
    tasks: int = 0
    pushed: int = 0
    refused: int = 0
    duplicates: int = 0
    retries: int = 0
    rejoins: int = 0
    bytes_payload: int = 0
    refusals: list[str] = field(default_factory=list)
    #: The latest global version the server named (a stop names the run's last): -1 before.
    version: int = -1


class ClientRuntime:
    """Drives one client identity against an aggregator through a :class:`Transport`.

    The codec choice, the encoder's seed, update ids and what to do on a refusal follow
    :mod:`murmura.client.rules`, which the simulator's engine follows too. Update ids are
    random unless ``update_ids`` is a seeded :class:`~murmura.client.rules.UpdateIds`.

    The client's identity is an Ed25519 key (``identity``; a fresh ephemeral one when neither
    it nor ``client_id`` is given): its id derives from the key, it proves the key at every
    Join and signs every update (docs/security.md). A bare ``client_id`` without a key joins
    unsigned, which only a server with ``require_identity = False`` accepts.
    """

    def __init__(self, transport: Transport, trainer: Trainer, *, client_id: str = "",
                 identity: NodeKey | None = None,
                 profile: DeviceProfile | None = None, token: str = "", codec: str = "",
                 retry: RetryPolicy | None = None, wait_s: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 update_hook: UpdateHook | None = None,
                 update_ids: UpdateIds | None = None,
                 on_ack: Callable[[str, PushResult], None] | None = None,
                 fatal_refusals: frozenset[str] = frozenset(),
                 give_up_unreached_s: float | None = None,
                 require_secagg: bool = False) -> None:
        self.transport = transport
        self.trainer = trainer
        if identity is None and not client_id:
            identity = NodeKey.generate()
        if identity is not None:
            if client_id and client_id != identity.client_id:
                raise ValueError(f"client_id {client_id[:40]!r} is not the id of the given key "
                                 f"({identity.client_id}); leave it empty")
            client_id = identity.client_id
        self.identity = identity
        self.client_id = client_id
        self.profile = profile or DeviceProfile()
        self.token = token
        #: ``codec='auto'``: the first update goes dense (or as the server says), then the
        #: codec is chosen from that push's measured link speed (:func:`rules.auto_codec`).
        self.auto_codec = codec == "auto"
        self.codec_name = "" if self.auto_codec else codec
        self.retry = retry or RetryPolicy()
        self.wait_s = wait_s
        self.sleep = sleep
        self.clock = clock
        self.update_hook = update_hook
        self.update_ids = update_ids or UpdateIds()
        #: Called with each acknowledged update's id and the server's answer (an audit trail:
        #: ``murmura client --ack-log`` writes them to a file).
        self.on_ack = on_ack
        #: Statuses of a refused update that end the run (RemoteError) instead of moving on to
        #: the next task: a leaf's link uses it, since none of its later partials would count.
        self.fatal_refusals = fatal_refusals
        #: Give up this many seconds after ``first_try`` while the transport has never been
        #: connected (a wrong address or port fails in seconds, not after ``retry``'s
        #: minutes); once connected, ``retry`` alone decides. None: ``retry`` alone.
        self.give_up_unreached_s = give_up_unreached_s
        #: When the first contact was tried (``clock``): set by the first request, or earlier
        #: by a caller that tried the transport itself before building this runtime.
        self.first_try: float | None = None
        self.stats = ClientStats()
        #: Called after each task with its :class:`TaskReport` (None: nothing is reported).
        self.on_task: Callable[[TaskReport], None] | None = None
        self.session = ""
        self.settings: TaskSettings | None = None
        self.spec: ModelSpec | None = None
        self._encoder: Encoder | None = None
        self._rand = jitter_rng(client_id)  # the backoff's jitter
        self._pool: SeedPool | None = None
        self._pool_base: tuple[int, FlatVector] | None = None  # (base_version, base)
        #: The run's secure-aggregation encoding (from Join), None when the run has none.
        self.secagg: SecAggParams | None = None
        #: Tests: called with each SecAgg step's name before the client takes it.
        self.secagg_hook: StepHook | None = None
        #: Refuse a server without secure aggregation (``murmura client --secure-aggregation``).
        self.require_secagg = require_secagg

    # -- plumbing -----------------------------------------------------------------------------

    def _join(self) -> None:
        if self.identity is not None:
            result, spec = self.transport.join_as(self.identity, self.profile, self.token)
        else:
            result, spec = self.transport.join(self.client_id, self.profile, self.token)
        if spec.fingerprint() != self.trainer.spec.fingerprint():
            try:  # this client cannot take part: end the session it was given at once
                self.transport.leave(result.session)
            except RemoteError:
                pass
            raise ValueError(f"the server trains model spec {spec.fingerprint()} "
                             f"({spec.size} values); this client's model is "
                             f"{self.trainer.spec.fingerprint()} ({self.trainer.spec.size} values)")
        if self.require_secagg and result.secagg is None:
            try:  # this client only sends masked updates: end the session it was given
                self.transport.leave(result.session)
            except RemoteError:
                pass
            raise ValueError("the server does not run secure aggregation, and this client "
                             "requires it (--secure-aggregation): nothing was sent")
        first = not self.session
        self.session, self.settings, self.spec = result.session, result.settings, spec
        self.secagg = result.secagg
        self._pool = seed_pool_for(result.settings)
        if first or self._encoder is None:
            self._encoder = make_encoder(result.settings, spec.size, self.client_id,
                                         self.codec_name)
            self.codec_name = codec_choice(result.settings, self.codec_name)[0]
        log.info("%s joined (%s mode, codec %s)", self.client_id, result.mode, self.codec_name)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` with backoff on retryable errors and a re-join on a lost session."""
        backoff = self.retry.start(self.clock(), self._rand)
        if self.first_try is None:
            self.first_try = backoff.started
        while True:
            try:
                return fn()
            except RemoteError as exc:
                action = after_refusal(exc.status, exc.retry_after_s)
                if action == "rejoin" and self.session:
                    log.info("%s: session lost (%s); joining again", self.client_id, exc.message)
                    self.stats.rejoins += 1
                    self.session = ""
                    fn_join: Callable[[], None] = self._join
                    self._call(fn_join)
                    continue
                pause = (backoff.next_pause(self.clock(), exc.retry_after_s)
                         if action == "retry" else None)
                if pause is not None and not self.transport.connected:
                    pause = self._unreached_pause(pause, exc)
                if pause is None:
                    raise
                self.stats.retries += 1
                log.info("%s: %s; retrying in %.2fs", self.client_id, exc.status, pause)
                self.sleep(pause)

    def _unreached_pause(self, pause: float, exc: RemoteError) -> float:
        """``pause``, cut to end at the never-connected deadline; past it, the error to exit
        with: the transport's reason (the address, what failed) and how long it tried."""
        limit = self.give_up_unreached_s
        if limit is None or self.first_try is None:
            return pause
        left = self.first_try + limit - self.clock()
        if left <= 0:
            raise RemoteError(exc.status, f"{exc.message}; gave up after {limit:g} s without "
                                          f"ever reaching it (--give-up-unreached-s)") from None
        return min(pause, left)

    # -- the loop -----------------------------------------------------------------------------

    def run(self, *, max_tasks: int = 0) -> ClientStats:
        """Work until the server says stop (or ``max_tasks`` tasks are done); then leave."""
        self._call(self._join)
        try:
            while not max_tasks or self.stats.tasks < max_tasks:
                task = self._call(lambda: self.transport.task(self.session, self.wait_s))
                self.stats.version = max(self.stats.version, task.version)
                if task.action == Action.STOP:
                    log.info("%s: server says stop", self.client_id)
                    break
                if task.action == Action.WAIT:
                    if task.retry_after_s > 0 and self.wait_s == 0:
                        self.sleep(task.retry_after_s)
                    continue
                self.step(task.round, task.seed, local_steps=task.local_steps)
        finally:
            try:
                if self.session:
                    self.transport.leave(self.session)
            except RemoteError:
                pass
        return self.stats

    def _pull(self) -> tuple[int, FlatVector]:
        """The current version and model: pulled whole, or in a seed-pool run rebuilt exactly
        from the pool's base (pulled once) and K downloaded scalars (see server/pool.py)."""
        if self._pool is None:
            return self._call(lambda: self.transport.pull(self.session))
        pool = self._pool

        def fetch() -> tuple[int, FlatVector]:
            # one retryable unit: a base that changes between the two pulls is retried whole
            version, base_version, scalars = self.transport.pull_pool_scalars(self.session)
            if scalars.shape != (len(pool),) or not np.isfinite(scalars).all():
                raise RemoteError("DATA_LOSS", f"the server sent {scalars.shape} pool scalars "
                                               f"(or non-finite ones); the pool has {len(pool)}")
            if self._pool_base is None or self._pool_base[0] != base_version:
                got, base = self.transport.pull_pool_base(self.session)
                if got != base_version or base.shape != (self.trainer.spec.size,):
                    raise RemoteError("ABORTED", "the seed pool's base changed during the pull")
                self._pool_base = (got, base)
                log.info("%s: pulled the seed pool's base (version %d)", self.client_id, got)
            return version, scalars

        version, scalars = self._call(fetch)
        assert self._pool_base is not None
        return version, pool_model(self._pool_base[1], pool, scalars)

    def step(self, round_: int, seed: int, *, local_steps: int = 0) -> None:
        """One task: pull the current model, train, push the update.

        ``local_steps`` > 0 is the server's per-task assignment (FedCompass gives faster
        devices more steps); it replaces the join settings' own amount of local work.
        """
        assert self.settings is not None and self._encoder is not None
        settings = (dataclasses.replace(self.settings, local_steps=local_steps) if local_steps
                    else self.settings)
        version, base = self._pull()
        self.trainer.on_pull(version)
        t_train = self.clock()
        result = self.trainer.train(base, settings, seed=seed)  # reads, never writes base
        train_s = self.clock() - t_train
        if self.secagg is not None:
            self._secagg_round(round_, version, base, result.params, result.num_examples)
            return
        if result.encoded is not None:
            codec, payload = result.encoded
        else:
            assert result.params is not None
            update = delta_of(result.params, base)
            if self.update_hook is not None:
                update = self.update_hook(update)
            codec, payload = self.codec_name, self._encoder.encode(update)
        update_id = self.update_ids()  # kept by every retry of this push: counted once
        metrics = dict(result.metrics)
        digest = payload_digest(payload) if self.identity is not None else b""

        def push() -> PushResult:
            header = UpdateHeader(session=self.session, update_id=update_id, base_version=version,
                                  round=round_, num_examples=result.num_examples, codec=codec,
                                  payload_bytes=len(payload), metrics=metrics,
                                  spec_fingerprint=self.trainer.spec.fingerprint())
            if self.identity is not None:  # signed per attempt: a re-join changes the session
                header = self.identity.sign_update(header, digest)
            return self.transport.push(header, payload)

        self.stats.tasks += 1
        t_push = self.clock()
        try:
            reply = self._call(push)
        except RemoteError as exc:
            if after_refusal(exc.status, exc.retry_after_s) == "retry":
                raise  # _call retried until the policy gave up
            # next_task (a session lost and not regained lands here too, as before)
            self.stats.refused += 1
            self.stats.refusals.append(exc.status)
            if self.on_task is not None:
                self.on_task(TaskReport(version, result.num_examples, metrics, False,
                                        refused=exc.status))
            if run_is_over(exc.status, exc.message):  # a normal end: the next task says stop
                log.info("%s: the run is over; this update came too late", self.client_id)
                return
            if exc.status in self.fatal_refusals:
                raise
            log.warning("%s: update refused: %s", self.client_id, exc)
            return
        self.stats.pushed += 1
        self.stats.bytes_payload += len(payload)
        if self.auto_codec and result.encoded is None:
            self._choose_codec(len(payload), self.clock() - t_push, train_s)
        if getattr(reply, "duplicate", False):
            self.stats.duplicates += 1
        if self.on_ack is not None:
            self.on_ack(update_id, reply)
        if self.on_task is not None:
            self.on_task(TaskReport(version, result.num_examples, metrics, True,
                                    staleness=int(getattr(reply, "staleness", 0)),
                                    duplicate=bool(getattr(reply, "duplicate", False))))

    def _secagg_round(self, round_: int, version: int, base: FlatVector,
                      params: FlatVector | None, examples: int) -> None:
        """Send the update masked, through the round's SecAgg+ steps (client/secagg.py)."""
        assert self.secagg is not None
        self.stats.tasks += 1
        if params is None:
            raise ValueError("secure aggregation masks the trained model's delta; this "
                             "trainer sends encoded updates")
        update = delta_of(params, base)
        if self.update_hook is not None:
            update = self.update_hook(update)
        client = SecAggClient(self.client_id, round_, self.secagg, identity=self.identity,
                              require_identity=self.identity is not None)
        try:
            stage = run_round(self.transport.secagg_link(), session=self.session,
                              round_id=round_, client=client, update=update,
                              examples=max(examples, 1), base_version=version,
                              spec_fingerprint=self.trainer.spec.fingerprint(),
                              identity=self.identity, wait_s=max(self.wait_s, 1.0),
                              hook=self.secagg_hook)
        except (RemoteError, SecAggRefused) as exc:
            self.stats.refused += 1
            self.stats.refusals.append(getattr(exc, "status", "SECAGG_REFUSED"))
            log.warning("%s: secure-aggregation round %d failed: %s", self.client_id, round_,
                        exc)
            return
        if stage == "DONE":
            self.stats.pushed += 1
        log.info("%s: secure-aggregation round %d ended %s", self.client_id, round_, stage)

    def _choose_codec(self, payload_bytes: int, push_s: float, train_s: float) -> None:
        """``codec='auto'``: pick the codec for the next updates from this push's speed."""
        assert self.spec is not None
        self.auto_codec = False  # decided once, so error-feedback state is kept from here on
        choice = auto_switch(4 * self.spec.size, payload_bytes, push_s, train_s,
                             self.codec_name or (self.settings.codec if self.settings else ""))
        if choice is None:
            return
        name, options = choice
        self._encoder = create_codec(name, options).encoder(
            self.spec.size, seed=encoder_seed(self.client_id))
        self.codec_name = name
        log.info("%s: link %.2f MB/s, training %.2fs: codec %s", self.client_id,
                 payload_bytes / push_s / 1e6, train_s, name)
