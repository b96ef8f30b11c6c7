"""Telemetry: what an aggregator is doing, readable at any moment without slowing it down.

:class:`Telemetry` is owned by the core (``core.telemetry``) and fed by one-line hooks in the
core's jobs (a join, a received payload, an accepted or refused update, a published version,
an RPC's duration). Every hook runs on the core's own thread, the only thread that changes
the core, and does O(1) work: a few dict and attribute updates, no locks, no I/O. The
counters the core keeps already (``core.traffic``: updates, refusals by reason, bytes) are
read from it, not counted twice, so the figures agree with ``metrics.jsonl``.

Readers on other threads (the Prometheus endpoint, a dashboard) go through :meth:`read`,
which runs the reading function on the core's thread (``core.post``), so they never see a
half-made change. :meth:`snapshot` is the JSON contract a dashboard builds on.
"""

from __future__ import annotations

import concurrent.futures
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from murmura.server.errors import ServiceError
from murmura.server.outputs import clean_row

if TYPE_CHECKING:
    from murmura.aggregation import Aggregator
    from murmura.server.core import AggregatorCore
    from murmura.server.sessions import ClientRecord

__all__ = ["MAX_CLIENTS", "RPC_BUCKETS_S", "ClientStats", "RpcHistogram", "Telemetry",
           "timed_handlers"]

T = TypeVar("T")

#: Clients remembered in the per-client table; beyond it the least recently active goes (a
#: flood of identities cannot grow memory; an evicted client that comes back starts afresh).
MAX_CLIENTS = 100_000
#: Clients a :meth:`Telemetry.snapshot` lists by default, most recently active first: a
#: dashboard polling a 100k-client run should not build a 20 MB answer on the event loop.
SNAPSHOT_CLIENTS = 1_000
#: Upper bounds (seconds) of the RPC duration histogram. GetTask long-polls for up to 30 s,
#: so the top buckets are wide.
RPC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 60.0)
#: Codec label for payloads whose codec is not registered (a hostile name must not become
#: a label value).
OTHER_CODEC = "other"


@dataclass(slots=True)
class ClientStats:
    """One client's figures. ``record`` is its latest session's record, whose ``last_seen``
    the core updates on every request (so no hook is needed for "seen")."""

    client_id: str
    device: str
    steps_per_s: float
    record: ClientRecord
    updates: int = 0
    last_staleness: int | None = None
    weight: float | None = None
    refusals: int = 0


@dataclass(slots=True)
class RpcHistogram:
    """Durations of one RPC method: counts per bucket of :data:`RPC_BUCKETS_S` (the last one
    past the largest bound) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(RPC_BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(RPC_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds


def _device(profile: Any) -> str:
    kind, name = str(profile.device), str(profile.device_name)
    return f"{kind}: {name}" if name else kind


class Telemetry:
    """Counters, a per-client table and histograms of one aggregator (see the module
    docstring). All methods but :meth:`read` run on the core's thread."""

    def __init__(self, core: AggregatorCore, *, max_clients: int = MAX_CLIENTS,
                 role: str = "server") -> None:
        from murmura.protocols.codecs import available_codecs
        from murmura.server.decoding import PARTIAL_CODEC

        self.core = core
        self.role = role
        self.max_clients = max_clients
        self.started_unix = time.time()
        #: client id -> its figures, least recently active first.
        self.clients: OrderedDict[str, ClientStats] = OrderedDict()
        #: staleness (versions) -> accepted updates; bounded by ``max_staleness`` (staler
        #: updates are refused).
        self.staleness: dict[int, int] = {}
        #: codec -> payload bytes received (the wire bytes of refused pushes too, as
        #: ``traffic.bytes_up`` counts them); unregistered names count as ``other``.
        self.bytes_in: dict[str, int] = {}
        self.versions = 0
        self.rpc: dict[str, RpcHistogram] = {}
        self._codecs = frozenset([*available_codecs(), PARTIAL_CODEC])
        #: (client ids, weights) of the rule's last aggregate, taken on the publisher thread.
        self._weights: tuple[list[str], list[float]] | None = None

    # -- hooks (the core's thread) ------------------------------------------------------------

    def _stats(self, rec: ClientRecord) -> ClientStats:
        stats = self.clients.get(rec.client_id)
        if stats is None:
            stats = ClientStats(rec.client_id, _device(rec.profile),
                                float(rec.profile.steps_per_s), rec)
            self.clients[rec.client_id] = stats
            if len(self.clients) > self.max_clients:
                self.clients.popitem(last=False)
        else:
            self.clients.move_to_end(rec.client_id)
        return stats

    def joined(self, rec: ClientRecord) -> None:
        """A session opened: the client's device as its profile says."""
        stats = self._stats(rec)
        stats.record = rec
        stats.device, stats.steps_per_s = _device(rec.profile), float(rec.profile.steps_per_s)

    def received(self, codec: str, nbytes: int) -> None:
        """A push's bytes crossed the wire (counted before any check, like ``bytes_up``)."""
        key = codec if codec in self._codecs else OTHER_CODEC
        self.bytes_in[key] = self.bytes_in.get(key, 0) + nbytes

    def accepted(self, rec: ClientRecord, staleness: int) -> None:
        """An update was taken into the policy."""
        stats = self._stats(rec)
        stats.record = rec
        stats.updates += 1
        stats.last_staleness = staleness
        self.staleness[staleness] = self.staleness.get(staleness, 0) + 1

    def refused(self, session: str, exc: BaseException) -> None:
        """A push of ``session`` was refused. Called before ``count_refusal``, which marks
        the error counted: a refusal that surfaces twice is attributed once."""
        if not isinstance(exc, ServiceError) or exc.counted:
            return
        rec = self.core.sessions.get(session)
        if rec is not None:
            self._stats(rec).refusals += 1

    def took_weights(self, aggregator: Aggregator) -> None:
        """On the publisher thread, just after the rule's ``result()``: the per-update
        weights a rule exposes (the Sybil-weighting rules' ``last_ids``/``last_weights``),
        kept until the version is installed. Other rules expose none."""
        ids, weights = getattr(aggregator, "last_ids", None), getattr(aggregator,
                                                                      "last_weights", None)
        if ids is None or weights is None:
            return
        try:  # a registered rule's attributes: never let them drop the version
            if len(ids) == len(weights):
                self._weights = ([str(i) for i in ids], [float(w) for w in weights])
        except (TypeError, ValueError):
            self._weights = None

    def published(self) -> None:
        """A version was installed: count it and give its clients the rule's latest weights
        (read, not taken: the publisher may already have made the next version's)."""
        self.versions += 1
        taken = self._weights
        if taken is not None:
            for client_id, weight in zip(*taken, strict=True):
                stats = self.clients.get(client_id)
                if stats is not None:
                    stats.weight = weight

    def observe_rpc(self, method: str, seconds: float) -> None:
        """An RPC handler of ``method`` took ``seconds`` (see :func:`timed_handlers`)."""
        histogram = self.rpc.get(method)
        if histogram is None:
            histogram = self.rpc[method] = RpcHistogram()
        histogram.observe(seconds)

    # -- reading ------------------------------------------------------------------------------

    def read(self, fn: Callable[[], T], timeout_s: float = 2.0) -> T:
        """``fn()`` run on the core's thread, for a caller on any other thread (never call it
        from the core's own event loop: it would wait for itself). Raises TimeoutError if the
        core's thread does not get to it in ``timeout_s``."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the reader gave up
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                done.set_exception(exc)

        try:
            self.core.post(run)
        except RuntimeError:  # the server's loop is closed: nothing changes the core now
            return fn()
        try:
            return done.result(timeout_s)
        except concurrent.futures.TimeoutError:
            done.cancel()
            raise TimeoutError(f"the aggregator's thread did not answer in {timeout_s:g} s"
                               ) from None

    def tier(self) -> dict[str, int]:
        """Aggregation workers, decode jobs waiting, cold starts (zeros without a tier)."""
        extras = self.core.row_extras() if self.core.row_extras is not None else {}
        return {"workers": int(extras.get("workers", 0)),
                "queue_depth": int(extras.get("queue", 0)),
                "cold_starts": int(extras.get("cold_starts", 0))}

    def run_info(self) -> dict[str, Any]:
        core = self.core
        out = core.recorder.out_dir if core.recorder is not None else (
            core.checkpoint_path.parent if core.checkpoint_path is not None else None)
        return {"name": out.name if out is not None else "",
                "dir": str(out) if out is not None else "", "mode": core.config.mode,
                "rule": core.config.policy.defense, "started_unix": self.started_unix}

    def snapshot(self, *, max_clients: int | None = SNAPSHOT_CLIENTS) -> dict[str, Any]:
        """The JSON-ready state of the run (the dashboard's contract; keys are fixed).

        ``clients`` lists the ``max_clients`` most recently active clients (None: all, up to
        :data:`MAX_CLIENTS`). Call on the core's thread, or through :meth:`read`.
        """
        core = self.core
        traffic = core.traffic
        now = core.clock()
        sessions = core.sessions
        clients: list[dict[str, Any]] = []
        if max_clients is None or max_clients > 0:
            for stats in reversed(self.clients.values()):
                if max_clients is not None and len(clients) >= max_clients:
                    break
                rec = stats.record
                clients.append({
                    "client_id": stats.client_id, "device": stats.device,
                    "steps_per_s": stats.steps_per_s,
                    "last_seen_s_ago": round(max(now - rec.last_seen, 0.0), 3),
                    "updates": stats.updates, "last_staleness": stats.last_staleness,
                    "weight": stats.weight, "refusals": stats.refusals,
                    "active": sessions.get(rec.session) is rec})
        return {
            "role": self.role,
            "run": self.run_info(),
            "version": core.version,
            "done": bool(core.done),
            "clients_active": len(sessions),
            "updates_total": traffic.updates,
            "refused_total": dict(traffic.refused_by_reason),
            "versions_total": self.versions,
            "bytes_in_total": dict(self.bytes_in),
            "bytes_out_total": traffic.bytes_down,
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness.items())},
            "metrics": clean_row(dict(core.last_metrics)),
            "clients": clients,
            "tier": self.tier(),
            "peers": [],
        }

    def rpc_histograms(self) -> dict[str, tuple[list[int], float]]:
        """A copy of the RPC durations: method -> (bucket counts, sum of seconds)."""
        return {m: (list(h.counts), h.sum_s) for m, h in self.rpc.items()}


def timed_handlers(handlers: Mapping[str, Any], observe: Callable[[str, float], None]
                   ) -> dict[str, Any]:
    """gRPC aio method handlers whose behaviours report their duration to ``observe(method,
    seconds)`` (a streamed answer: until its last item). The label set is the handlers'
    method names, so it is bounded whatever the clients call.

    This is what a server interceptor would do, without one: the aio server is built before
    the servicer, and wrapping each handler keeps the measurement next to the service."""
    return {name: _timed(name, handler, observe) for name, handler in handlers.items()}


def _timed(method: str, handler: Any, observe: Callable[[str, float], None]) -> Any:
    clock = time.perf_counter
    if handler.response_streaming:
        inner = handler.unary_stream if handler.unary_stream is not None \
            else handler.stream_stream

        async def stream(request: Any, context: Any) -> Any:
            t0 = clock()
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                observe(method, clock() - t0)

        kind = "unary_stream" if handler.unary_stream is not None else "stream_stream"
        return handler._replace(**{kind: stream})
    inner = handler.unary_unary if handler.unary_unary is not None else handler.stream_unary

    async def unary(request: Any, context: Any) -> Any:
        t0 = clock()
        try:
            return await inner(request, context)
        finally:
            observe(method, clock() - t0)

    kind = "unary_unary" if handler.unary_unary is not None else "stream_unary"
    return handler._replace(**{kind: unary})
