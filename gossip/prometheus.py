"""A gossip peer's Prometheus metrics and telemetry snapshot (``murmura peer --metrics-address``).

Read at scrape time from what :class:`~murmura.gossip.runtime.PeerRuntime` counts already
(its :class:`~murmura.gossip.runtime.PeerStats`, round, view and transport): nothing is added
to the peer's loop. Counters and the round are plain attributes, read atomically; the view is
copied under the runtime's lock, waited for briefly (a mix holds it). The HTTP endpoint is the
aggregator's (:class:`murmura.server.prometheus.MetricsEndpoint`, wired by the command line:
gossip does not import the server). Names follow the aggregator's (docs/operations.md).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from murmura.gossip.runtime import PeerRuntime

__all__ = ["PeerCollector", "peer_snapshot"]

#: Seconds a snapshot waits for the runtime's lock (held while a round mixes) for the view.
LOCK_WAIT_S = 0.5


def _view(runtime: PeerRuntime) -> list[dict[str, Any]]:
    """The view's entries, copied under the runtime's lock (empty if it stays busy)."""
    lock = runtime._lock
    if not lock.acquire(timeout=LOCK_WAIT_S):
        return []
    try:
        entries = runtime.node.view.entries()
    finally:
        lock.release()
    return [{"peer_id": e.peer_id, "address": e.address, "round": e.round, "age": e.age}
            for e in entries]


def peer_snapshot(runtime: PeerRuntime, *, metrics: Callable[[], dict[str, Any]] | None = None,
                  started_unix: float | None = None) -> dict[str, Any]:
    """The aggregator's snapshot contract (:meth:`murmura.server.telemetry.Telemetry.snapshot`)
    for a peer: ``version`` is its round, ``updates_total`` the neighbour models it mixed,
    ``versions_total`` its rounds done, ``peers`` its view; server-only keys are empty.
    ``metrics``: the latest evaluation row (``murmura peer`` evaluates each round)."""
    stats, cfg = runtime.stats, runtime.config
    stopping = runtime._stop.is_set() or runtime.node.round >= runtime._end
    return {
        "role": "peer",
        "run": {"name": runtime.peer_id, "dir": "", "mode": f"gossip ({cfg.topology})",
                "rule": cfg.rule, "started_unix": started_unix or 0.0},
        "version": runtime.node.round,
        "done": bool(stopping),
        "clients_active": 0,
        "updates_total": stats.mixed,
        "refused_total": {},
        "versions_total": stats.rounds,
        "bytes_in_total": {},
        "bytes_out_total": runtime.transport.bytes_sent,
        "staleness_hist": {},
        "metrics": dict(metrics()) if metrics is not None else {},
        "clients": [],
        "tier": {"workers": 0, "queue_depth": 0, "cold_starts": 0},
        "peers": _view(runtime),
    }


class PeerCollector:
    """A peer's metric families (a custom ``prometheus_client`` collector)."""

    def __init__(self, runtime: PeerRuntime, *,
                 metrics: Callable[[], dict[str, Any]] | None = None) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.started_unix = time.time()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rt = self.runtime
        stats, cfg = rt.stats, rt.config
        info = InfoMetricFamily("murmura_run", "The run this process serves.")
        info.add_metric([], {"role": "peer", "mode": "gossip", "topology": cfg.topology,
                             "rule": cfg.rule})
        yield info
        yield GaugeMetricFamily("murmura_run_start_time_seconds",
                                "When this process started serving (Unix time).",
                                value=self.started_unix)
        yield GaugeMetricFamily("murmura_peer_round", "The round this peer is in.",
                                value=rt.node.round)
        yield CounterMetricFamily("murmura_peer_rounds_total", "Rounds this peer finished.",
                                  value=stats.rounds)
        yield GaugeMetricFamily("murmura_peer_neighbours",
                                "Peers in this peer's view (its possible neighbours).",
                                value=len(rt.node.view))
        for name, doc, value in (
                ("murmura_peer_models_sent_total", "Models (or step logs) neighbours took.",
                 stats.sent),
                ("murmura_peer_models_received_total", "Neighbours' models this peer took.",
                 stats.received),
                ("murmura_peer_models_mixed_total", "Neighbours' models mixed into this one.",
                 stats.mixed),
                ("murmura_peer_send_failures_total", "Sends given up (unreachable or refused).",
                 stats.send_failures),
                ("murmura_peer_send_retries_total", "Sends and joins retried after a failure.",
                 stats.retries)):
            yield CounterMetricFamily(name, doc, value=value)
        refused = CounterMetricFamily("murmura_peer_sends_refused_total",
                                      "Sends a neighbour refused, by gRPC status.",
                                      labels=["status"])
        for status, n in sorted(Counter(list(stats.refusals)).items()):
            refused.add_metric([str(status)], n)
        yield refused
        yield CounterMetricFamily("murmura_bytes_sent_total",
                                  "Bytes this peer sent on the wire (models, shuffles).",
                                  value=rt.transport.bytes_sent)
        row = self.metrics() if self.metrics is not None else {}
        for key, name, doc in (("accuracy", "murmura_test_accuracy",
                                "Test accuracy of this peer's model after its last round."),
                               ("loss", "murmura_test_loss",
                                "Test loss of this peer's model after its last round.")):
            measured = row.get(key)
            if isinstance(measured, (int, float)):
                yield GaugeMetricFamily(name, doc, value=float(measured))
