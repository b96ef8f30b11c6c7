"""The aggregator's Prometheus endpoint: ``--metrics-address HOST:PORT`` (docs/operations.md).

Nothing here runs per event. :class:`AggregatorCollector` is a custom ``prometheus_client``
collector that, when scraped, takes one sample of :class:`~murmura.server.telemetry.Telemetry`
on the core's thread (``Telemetry.read``) and turns it into metric families; concurrent
scrapes within ``min_interval_s`` share that sample, so a flood of scrapes costs the event
loop one small callback per interval. :class:`MetricsEndpoint` serves it over HTTP from its own
threads, hardened for an open port: only ``GET /metrics``, bounded request line and query,
a socket timeout per connection, and a cap on connections served at once (the rest get 503).

Names follow Prometheus conventions: base units in the name (``_seconds``, ``_bytes``),
counters end in ``_total``, and every label has a bounded set of values (never a client id).
"""

from __future__ import annotations

import logging
import re
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from murmura.server.telemetry import RPC_BUCKETS_S, Telemetry

log = logging.getLogger(__name__)

__all__ = ["STALENESS_BUCKETS", "AggregatorCollector", "MetricsEndpoint", "Sampler",
           "cumulative", "serve_metrics", "split_address"]

#: Upper bounds (versions) of the staleness histogram's buckets.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100)
#: Longest query string answered; a longer one gets 414 (the HTTP server itself refuses a
#: request line over 64 KiB before any of this runs).
MAX_QUERY = 2048
#: Connections served at once; more are answered 503 and closed at once.
MAX_CONNECTIONS = 16
#: A node id (protocols/identity.py: ``n-`` and 26 base32 characters).
NODE_ID = re.compile(r"n-[a-z2-7]{26}")
#: Seconds a connection may stall on a read or a write before it is dropped.
SOCKET_TIMEOUT_S = 10.0


def split_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT`` -> (host, port)."""
    host, _, port = value.strip().rpartition(":")
    return host.strip("[]"), int(port)


def cumulative(counts: dict[int, int], bounds: Iterable[float]) -> list[tuple[str, float]]:
    """Prometheus buckets (``le``, cumulative count, ``+Inf`` last) from exact counts."""
    ordered = sorted(counts.items())
    out, total, i = [], 0, 0
    for bound in bounds:
        while i < len(ordered) and ordered[i][0] <= bound:
            total += ordered[i][1]
            i += 1
        out.append((f"{bound:g}" if isinstance(bound, float) else str(bound), float(total)))
    out.append(("+Inf", float(sum(counts.values()))))
    return out


def refusal_labels(by_reason: dict[str, int], core: Any) -> dict[tuple[str, str], int]:
    """``STATUS: reason`` counts as (status, reason) label pairs with no client in them: a
    word of a reason that is a node id (``n-`` and 26 base32 characters) or a client id the
    aggregator knows becomes ``…`` (a few refusal messages name the client unquoted)."""
    clients, sessions = core.telemetry.clients, core._session_of  # looked up, not copied
    out: dict[tuple[str, str], int] = {}
    for key, n in by_reason.items():
        status, _, reason = key.partition(": ")
        words = ["…" if w in clients or w in sessions or NODE_ID.fullmatch(w.strip(",.;"))
                 else w for w in reason.split()]
        label = (status, " ".join(words))
        out[label] = out.get(label, 0) + n
    return out


class Sampler:
    """One sample at a time, shared by the scrapes that come within ``min_interval_s``; when
    a fresh one cannot be taken (the owner's thread is busy past ``timeout_s``), the last one
    is served again rather than none."""

    def __init__(self, take: Callable[[], dict[str, Any]], *, min_interval_s: float = 0.5
                 ) -> None:
        self.take = take
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None
        self._at = -float("inf")

    def sample(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._at >= self.min_interval_s:
                try:
                    self._last = self.take()
                    self._at = now
                except TimeoutError:
                    if self._last is None:
                        raise
                    log.warning("metrics scrape: the owner's thread is busy; serving the "
                                "sample taken %.1f s ago", now - self._at)
            return self._last


class AggregatorCollector:
    """The aggregator's metric families, from one telemetry sample per scrape."""

    def __init__(self, telemetry: Telemetry, *, min_interval_s: float = 0.5,
                 timeout_s: float = 2.0) -> None:
        self.telemetry = telemetry
        self.timeout_s = timeout_s
        self.sampler = Sampler(lambda: telemetry.read(self._take, timeout_s),
                               min_interval_s=min_interval_s)

    def _take(self) -> dict[str, Any]:
        """On the core's thread: small copies only (no per-client work)."""
        t = self.telemetry
        core = t.core
        snap = t.snapshot(max_clients=0)
        snap["rpc"] = t.rpc_histograms()
        snap["staleness"] = dict(t.staleness)
        snap["buffered"] = int(core.policy.buffered())
        snap["refused_labels"] = refusal_labels(snap["refused_total"], core)
        # raw, not cleaned: epsilon is +inf when updates are clipped but not noised
        snap["dp"] = {k: core.last_metrics.get(k) for k in ("dp_epsilon", "dp_delta")}
        return snap

    def describe(self) -> list[Metric]:
        return []  # registering the collector must not take a sample

    def collect(self) -> Iterator[Metric]:
        s = self.sampler.sample()
        run = s["run"]
        info = InfoMetricFamily("murmura_run", "The run this process serves.")
        info.add_metric([], {"role": s["role"], "mode": run["mode"], "rule": run["rule"],
                             "name": run["name"]})
        yield info
        yield GaugeMetricFamily("murmura_run_start_time_seconds",
                                "When this process started serving (Unix time).",
                                value=run["started_unix"])
        yield GaugeMetricFamily("murmura_run_finished",
                                "1 once the run reached its last version.",
                                value=float(s["done"]))
        yield GaugeMetricFamily("murmura_model_version", "The current global model version.",
                                value=s["version"])
        yield CounterMetricFamily("murmura_versions_published_total",
                                  "Global versions published by this process.",
                                  value=s["versions_total"])
        yield CounterMetricFamily("murmura_updates_accepted_total",
                                  "Client updates taken into an aggregate (metrics.jsonl's "
                                  "updates).", value=s["updates_total"])
        refused = CounterMetricFamily("murmura_requests_refused_total",
                                      "Refused requests (pushes, joins, pulls) by gRPC status "
                                      "and short reason (metrics.jsonl's refused_by_reason).",
                                      labels=["status", "reason"])
        for (status, reason), n in sorted(s["refused_labels"].items()):
            refused.add_metric([status, reason], n)
        yield refused
        yield GaugeMetricFamily("murmura_updates_buffered",
                                "Updates taken and waiting for the next version.",
                                value=s["buffered"])
        staleness = s["staleness"]
        yield HistogramMetricFamily(
            "murmura_update_staleness_versions",
            "Staleness of accepted updates: versions between the one trained on and the one "
            "stepped.", buckets=cumulative(staleness, STALENESS_BUCKETS),
            sum_value=float(sum(k * v for k, v in staleness.items())))
        received = CounterMetricFamily("murmura_bytes_received_total",
                                       "Push bytes received on the wire, by codec.",
                                       labels=["codec"])
        for codec, n in sorted(s["bytes_in_total"].items()):
            received.add_metric([codec], n)
        yield received
        yield CounterMetricFamily("murmura_bytes_sent_total",
                                  "Model bytes sent to clients on the wire.",
                                  value=s["bytes_out_total"])
        yield GaugeMetricFamily("murmura_clients_active", "Clients with an open session.",
                                value=s["clients_active"])
        tier = s["tier"]
        yield GaugeMetricFamily("murmura_tier_workers", "Aggregation worker processes running.",
                                value=tier["workers"])
        yield GaugeMetricFamily("murmura_tier_queue_depth",
                                "Decode jobs waiting for an aggregation worker.",
                                value=tier["queue_depth"])
        yield CounterMetricFamily("murmura_tier_cold_starts_total",
                                  "Aggregation workers started for waiting work.",
                                  value=tier["cold_starts"])
        rpc = HistogramMetricFamily("murmura_rpc_duration_seconds",
                                    "Time gRPC handlers take, by method (GetTask includes its "
                                    "long poll, Pull and Push the whole stream).",
                                    labels=["method"])
        for method, (counts, total_s) in sorted(s["rpc"].items()):
            running, buckets = 0, []
            for bound, n in zip(RPC_BUCKETS_S, counts, strict=False):
                running += n
                buckets.append((f"{bound:g}", float(running)))
            buckets.append(("+Inf", float(sum(counts))))
            rpc.add_metric([method], buckets, sum_value=total_s)
        yield rpc
        metrics = s["metrics"]
        for key, name, doc in (("accuracy", "murmura_test_accuracy",
                                "Test accuracy of the current version (server evaluation)."),
                               ("loss", "murmura_test_loss",
                                "Test loss of the current version (server evaluation).")):
            value = metrics.get(key)
            if isinstance(value, (int, float)):  # absent until a version is evaluated
                yield GaugeMetricFamily(name, doc, value=float(value))
        epsilon, delta = s["dp"]["dp_epsilon"], s["dp"]["dp_delta"]
        if isinstance(epsilon, (int, float)):  # differential privacy on (docs/privacy.md)
            yield GaugeMetricFamily("murmura_dp_epsilon_spent",
                                    "Privacy budget spent so far: epsilon at dp_delta after the "
                                    "current version (+Inf: clipping without noise).",
                                    value=float(epsilon))
            if isinstance(delta, (int, float)):
                yield GaugeMetricFamily("murmura_dp_delta", "The delta epsilon is stated at.",
                                        value=float(delta))


class _Handler(WSGIRequestHandler):
    """A request handler that logs nothing and drops a connection stalled for
    :data:`SOCKET_TIMEOUT_S` (a slow client cannot hold a thread forever)."""

    timeout = SOCKET_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
         b"Connection: close\r\n\r\n")


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` at once."""

    daemon_threads = True
    block_on_close = False
    slots: threading.BoundedSemaphore

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host's name up (socket.getfqdn), which can hang
        # for seconds on a machine without DNS; the name only fills SERVER_NAME.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _guarded(app: Callable[..., Any]) -> Callable[..., Any]:
    """Only ``GET /metrics`` reaches the exposition; a long query is refused."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if len(environ.get("QUERY_STRING", "")) > MAX_QUERY:
            start_response("414 URI Too Long", [("Content-Type", "text/plain")])
            return [b"query string too long\n"]
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"Murmura serves its metrics at /metrics\n"]
        result: list[bytes] = app(environ, start_response)
        return result

    return guarded


class MetricsEndpoint:
    """``GET /metrics`` on ``address`` in background threads.

    The socket is bound when the object is made, so a taken port fails at once (before a
    task is loaded); :meth:`start` registers the collector and starts serving.
    """

    def __init__(self, address: str, *, max_connections: int = MAX_CONNECTIONS) -> None:
        host, port = split_address(address)
        self.registry = CollectorRegistry(auto_describe=False)

        class Server(_Server):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        Server.slots = threading.BoundedSemaphore(max_connections)
        try:
            self._httpd = make_server(host, port, _guarded(make_wsgi_app(self.registry)),
                                      Server, handler_class=_Handler)
        except OSError as exc:
            raise ValueError(f"--metrics-address: cannot listen on {address[:60]} "
                             f"({exc.strerror or exc}; port in use?)") from None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def address(self) -> str:
        host = str(self._httpd.server_address[0])
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def start(self, collector: Any) -> MetricsEndpoint:
        self.registry.register(collector)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="murmura-metrics")
        self._thread.start()
        log.info("Prometheus metrics on %s", self.url)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_metrics(telemetry: Telemetry, address: str, *, min_interval_s: float = 0.5
                  ) -> MetricsEndpoint:
    """An endpoint on ``address`` serving ``telemetry``'s aggregator, started (tests give
    ``min_interval_s=0``: every scrape a fresh sample)."""
    return MetricsEndpoint(address).start(AggregatorCollector(telemetry,
                                                              min_interval_s=min_interval_s))
