"""Running the aggregator: build a core for a task, serve it over gRPC, stop it cleanly."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from murmura.protocols import ModelSpec
from murmura.protocols.tls import is_loopback, server_credentials
from murmura.server.checkpoint import load_checkpoint
from murmura.server.config import ServerConfig, TierConfig
from murmura.server.core import VERSIONS_DIR, AggregatorCore, evaluator_for, link_current
from murmura.server.outputs import RunRecorder
from murmura.server.publisher import Publisher
from murmura.server.service import MAX_MESSAGE_BYTES, AggregatorServicer, add_servicer
from murmura.server.state import AggregatorState
from murmura.server.store import DB_NAME, SqliteState
from murmura.server.tier import Tier
from murmura.tasks import Task, TaskConfig, load_task
from murmura.tasks.app import AppTask

if TYPE_CHECKING:
    from murmura.server.columns import ProcessColumns
    from murmura.server.receivers import ReceiverHub

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.npz"


def build_core(config: ServerConfig, task_config: TaskConfig, *, out_dir: str | Path | None,
               resume: str | Path | None = None, evaluate: bool = True,
               extra_config: dict[str, Any] | None = None, task: Task | None = None,
               clock: Callable[[], float] = time.monotonic, checkpoint: bool = True,
               fresh_metrics: bool = False, durable: bool = False) -> AggregatorCore:
    """The one way an aggregator is assembled, for the gRPC server, a leaf, the simulator and
    the benchmarks: initial model, evaluator, outputs, checkpoint, policy and decoder.

    ``task`` reuses an already loaded task; ``clock`` is the simulator's virtual clock;
    ``fresh_metrics`` starts a new metrics file in ``out_dir``. The transport decides where
    decoding and publishing run (:class:`AggregatorServer` gives them workers and a thread).

    ``durable`` keeps the run's state in ``out_dir/state.db`` (server/store.py): a push is
    acknowledged once it is on disk, and if the directory already holds state the run resumes
    from it (sessions, counted ids, counters, the current version and the updates acknowledged
    but not yet published), whatever ``resume`` says.
    """
    task = task if task is not None else load_task(task_config)
    model = task.build_model(seed=config.seed)
    spec = ModelSpec.from_module(model)
    evaluator = (evaluator_for(task.model_factory, spec, task.test, task.evaluate)
                 if evaluate and task.test is not None else None)
    if evaluator is not None and isinstance(task, AppTask):
        # An app's evaluate() that returns the wrong thing (a bare float) stops the command
        # here, naming the app and what it must return, not at every version of a running run.
        evaluator(spec.flatten(model))
    return assemble_core(config, spec, spec.flatten(model), out_dir=out_dir, resume=resume,
                         evaluator=evaluator, clock=clock, checkpoint=checkpoint,
                         fresh_metrics=fresh_metrics, durable=durable, run_config={
                             "server": config.table(),
                             "task": dataclasses.asdict(task_config), **(extra_config or {})})


def assemble_core(config: ServerConfig, spec: ModelSpec, initial: Any, *,
                  out_dir: str | Path | None, resume: str | Path | None = None,
                  evaluator: Any = None, clock: Callable[[], float] = time.monotonic,
                  checkpoint: bool = True, fresh_metrics: bool = False,
                  durable: bool | AggregatorState = False,
                  run_config: dict[str, Any] | None = None) -> AggregatorCore:
    """:func:`build_core` once the model is known: outputs, checkpoint and durable state.

    ``durable=True`` keeps the state in ``out_dir`` (:class:`SqliteState`); an
    :class:`AggregatorState` passed instead is used as it is (a :class:`MemoryState` lets a
    test or a simulation restart an aggregator over the state the last one left).
    """
    store: AggregatorState | None = None
    stored = None
    if durable is not False:
        if out_dir is None or not checkpoint or config.leaf.role != "top":
            raise ValueError("durable state needs an output directory, checkpoints and the "
                             "top role")
        if isinstance(durable, AggregatorState):
            store = durable
            stored = store.load()
            existed = not stored.empty
        else:
            existed = (Path(out_dir) / DB_NAME).exists()
            store = SqliteState(out_dir)
            stored = store.load()
        if not existed or stored.empty:
            stored = None
        elif resume:
            log.warning("%s holds durable state; resuming from it, not from %s", out_dir,
                        resume)
    try:
        if stored is not None:
            assert out_dir is not None
            start = (load_checkpoint(Path(out_dir) / stored.checkpoint) if stored.checkpoint
                     else None)
        else:
            start = load_checkpoint(resume) if resume else None
        recorder = None
        checkpoint_path = None
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            if fresh_metrics and stored is None and (out / "metrics.jsonl").exists():
                (out / "metrics.jsonl").unlink()
            rows = stored.rows if stored is not None else None
            up_to = None  # keep the file's rows up to the version the run starts from
            if rows is None and (start is not None or store is not None):
                up_to = start.version if start is not None else 0
            recorder = RunRecorder(out_dir, rows=rows, up_to=up_to, config=run_config)
            checkpoint_path = out / CHECKPOINT_NAME if checkpoint else None
            if stored is not None and stored.checkpoint:
                # a crash may have left a newer, uncommitted checkpoint: the store names the
                # current one
                link_current(out, stored.checkpoint, out / CHECKPOINT_NAME)
            elif store is not None:
                for p in (out / VERSIONS_DIR).glob("v*.npz"):
                    p.unlink()
        core = AggregatorCore(config, spec, initial, evaluator=evaluator,
                              clock=clock, recorder=recorder, checkpoint_path=checkpoint_path,
                              start=start, store=store, stored=stored)
        if stored is not None:
            replayed = core.replay(stored.pending)
            log.info("resumed from the durable state in %s at version %d: %d sessions, %d "
                     "updates counted, %d acknowledged updates replayed", out_dir, core.version,
                     len(core.sessions), core.traffic.updates, replayed)
        elif start is not None:
            log.info("resumed from %s at version %d", resume, start.version)
        elif isinstance(store, SqliteState):
            log.info("durable state in %s", store.path)
    except BaseException:
        if store is not None:
            store.close()
        raise
    return core


class AggregatorServer:
    """A grpc.aio server around a core, bound to ``config.address`` (port 0 picks one).

    It assembles the serverless tier around the core: the gateway (this event loop), the
    aggregation functions (:class:`~murmura.server.tier.Tier`: worker processes, Ray, or inline
    for ``workers = 0``) and the publisher thread. Only byte moving and bookkeeping run on the
    event loop.
    """

    def __init__(self, core: AggregatorCore, address: str | None = None, *,
                 tick_s: float = 0.25) -> None:
        self.core = core
        self.tier: Tier | None = None
        self._columns: ProcessColumns | None = None
        self.requested_address = address or core.config.address
        self.tick_s = tick_s
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self.servicer: AggregatorServicer | None = None
        self.receivers: ReceiverHub | None = None

    @property
    def address(self) -> str:
        host = self.requested_address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        cfg = self.core.config
        security = cfg.security
        credentials = None
        if security.tls_cert:  # read and check the files first: a bad one fails before anything
            credentials = server_credentials(security.tls_cert, security.tls_key,
                                             security.client_ca or None)
        elif not security.insecure and not is_loopback(self.requested_address):
            raise ValueError(f"refusing to serve plaintext on {self.requested_address[:60]}: "
                             f"give --tls-cert and --tls-key, or --insecure")
        loop = asyncio.get_running_loop()
        # The backend first, before this process has a gRPC server: a local Ray forks its
        # daemons here, and nothing is served yet that its start-up could stall.
        self.tier = Tier.for_config(cfg.tier, self.core.decoder)
        warm_up = getattr(self.tier.backend, "warm_up", None)
        if warm_up is not None:  # the forkserver imports torch now, not in the first push
            await warm_up()
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self.core.publisher = Publisher(threaded=True)
        self.core.post = loop.call_soon_threadsafe
        self.core.row_extras = self.tier.stats
        self._fold_in_workers(cfg.tier)
        self._rule_in_workers(cfg.tier, loop)
        self.tier.post = loop.call_soon_threadsafe
        self.servicer = AggregatorServicer(self.core, tier=self.tier)
        add_servicer(self.servicer, server)
        if cfg.privacy.secure_aggregation:  # the masked steps (server/secagg_service.py)
            from murmura.server.secagg_service import (
                SecureAggregationServicer,
                add_secagg_servicer,
            )

            add_secagg_servicer(SecureAggregationServicer(self.core), server)
        if credentials is not None:
            self.port = server.add_secure_port(self.requested_address, credentials)
        else:
            self.port = server.add_insecure_port(self.requested_address)
        if self.port == 0:
            raise OSError(f"could not bind {self.requested_address}")
        await server.start()
        self._server = server
        if cfg.tier.receivers:  # pushes received in their own processes (server/receivers.py)
            try:
                await self._start_receivers(cfg.tier)
            except BaseException:
                await self.stop(grace=None)  # nothing half-started is left behind
                raise
        self.core.add_listener(self._check_done)
        self._ticker = asyncio.create_task(self._tick())
        where = ("in-process" if self.tier.inline else
                 f"{cfg.tier.backend} workers, up to {cfg.tier.worker_limit}")
        link = ("mutual TLS" if security.client_ca else "TLS") if credentials else "plaintext"
        log.info("aggregator listening on %s (mode=%s, decoding: %s, %s, identities %s)",
                 self.address, cfg.mode, where, link,
                 "required" if security.require_identity else "off")

    async def _start_receivers(self, tier: TierConfig) -> None:
        from murmura.server.receivers import ReceiverHub, TlsFiles

        security = self.core.config.security
        tls = TlsFiles(security.tls_cert, security.tls_key, security.client_ca) \
            if security.tls_cert else None
        assert self.servicer is not None
        self.receivers = hub = ReceiverHub(
            self.servicer, tier.receivers, host=self.requested_address.rsplit(":", 1)[0],
            port=tier.push_port, tls=tls, max_message_bytes=MAX_MESSAGE_BYTES)
        self.servicer.push_port = await hub.start()
        extras = self.core.row_extras
        self.core.row_extras = lambda: {**(extras() if extras is not None else {}),
                                        **hub.stats()}

    @property
    def push_port(self) -> int:
        """The receivers' port (0 without receivers: pushes go to :attr:`port`)."""
        return self.receivers.port if self.receivers is not None else 0

    def _fold_in_workers(self, tier: TierConfig) -> None:
        """Workers fold accepted updates into partial aggregates (server/folds.py) when the
        tier runs local process workers and the rule folds update by update."""
        from murmura.server.folds import FoldSlots
        from murmura.server.process_backend import ProcessBackend

        core, backend = self.core, self.tier.backend if self.tier is not None else None
        if tier.worker_folds == "off" or not isinstance(backend, ProcessBackend) \
                or core.buffers is not None:
            return
        aggregator = core.policy.aggregator
        if not FoldSlots.suits(aggregator, core.update_size, forced=tier.worker_folds == "on"):
            return
        core.folds = folds = FoldSlots(backend, core.decoder, size=core.update_size,
                                       exact=bool(getattr(aggregator, "exact", False)),
                                       width=tier.worker_limit)
        if core.store is not None:  # a damaged partial: the version is folded again
            folds.rebuild = core.refold
        # int8/int4/top-k payloads are checked, not decoded, and folded from their bytes
        self.tier.fuse = not folds.exact  # type: ignore[union-attr]
        tier_stats = self.tier.stats  # type: ignore[union-attr]
        core.row_extras = lambda: {**tier_stats(), **folds.stats()}
        log.info("updates are folded in the workers: up to %d partial aggregates of %.0f MB "
                 "per version", folds.width, folds.slot_bytes / 1e6)

    def _rule_in_workers(self, tier: TierConfig, loop: asyncio.AbstractEventLoop) -> None:
        """A rule that needs every update (``default``, median, ...) runs its per-coordinate
        work as column jobs on the tier's process workers (server/columns.py)."""
        from murmura.aggregation.robust import RobustAggregator
        from murmura.server.columns import MIN_COLUMNS, ProcessColumns
        from murmura.server.process_backend import ProcessBackend

        core, backend = self.core, self.tier.backend if self.tier is not None else None
        aggregator = core.policy.aggregator
        if not isinstance(backend, ProcessBackend) or not isinstance(aggregator, RobustAggregator) \
                or core.update_size < MIN_COLUMNS:
            return
        self._columns = columns = ProcessColumns(backend, workers=tier.worker_limit)
        columns.bind(loop)
        aggregator.use_columns(columns)
        extras = core.row_extras
        core.row_extras = lambda: {**(extras() if extras is not None else {}), **columns.stats()}
        log.info("the %s rule's per-coordinate work runs as column jobs on up to %d workers",
                 aggregator.name, tier.worker_limit)

    def _check_done(self) -> None:
        if self.core.done:
            self._done.set()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.core.tick()
                if self.tier is not None:
                    self.tier.tick()
            except Exception:  # a failing deadline check must not kill the server
                log.exception("tick failed")

    async def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until the run reached its last version; False on timeout."""
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self.receivers is not None:  # they finish their calls first
            await self.receivers.stop()
            self.receivers = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        # Versions being made are finished (metrics, checkpoint) before the tier goes.
        await asyncio.get_running_loop().run_in_executor(None, self.core.publisher.close)
        await asyncio.get_running_loop().run_in_executor(None, self.core.close)
        if self.tier is not None:
            await self.tier.close()
            self.tier = None
        if self.core.folds is not None:
            self.core.folds.close()
        if self._columns is not None:
            self._columns.close()
            self._columns = None


class ServerThread:
    """Runs an :class:`AggregatorServer` on its own event loop in a background thread.

    For tests and ``murmura run``: ``start()`` returns once the port is bound. Read the core only
    through :meth:`call`, which runs a function on the server's loop.
    """

    def __init__(self, core: AggregatorCore | Any, address: str | None = None) -> None:
        #: A core to serve, or a ready server-like object with async ``start``, ``stop`` and
        #: ``wait_done`` and an ``address`` (a :class:`~murmura.server.leaf.Leaf`).
        self._target = core
        self.core: AggregatorCore | None = core if isinstance(core, AggregatorCore) else None
        self._address = address
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="murmura-aggregator")
        self.server: Any = None

    def start(self) -> ServerThread:
        self._thread.start()
        if self.core is not None:
            self.server = AggregatorServer(self.core, self._address)
        else:
            self.server = self._target
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=60)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            raise
        if self.core is None:
            self.core = self.server.core
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.address.rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=60)

    def wait_done(self, timeout: float | None = None) -> bool:
        assert self.server is not None
        fut = asyncio.run_coroutine_threadsafe(self.server.wait_done(timeout), self._loop)
        return bool(fut.result())

    def stop(self, grace: float | None = 0.5) -> None:
        if self.server is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(30)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
