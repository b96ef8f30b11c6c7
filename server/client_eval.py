"""Evaluation on clients, as the server sees it: reports that ride on pushed updates, folded
into the next metrics row as a weighted mean, a minimum and a maximum per metric.

A client that evaluates the global model on its local test split (``client_eval_every``)
sends ``eval_version``, ``eval_examples`` and ``eval_<metric>`` in its update's metrics map, so
no message or RPC changes. Each report enters the row of the version its update helps make:
in sync mode that is version v + 1 for a report on version v; in async mode the row holds the
reports that arrived since the previous row (``client_eval_versions`` gives their range).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from murmura.server.limits import EVAL_PREFIX, MAX_NUM_EXAMPLES

log = logging.getLogger(__name__)

#: Bounds on a report, so no client can push a mean to overflow (as for ``num_examples``).
MAX_VALUE = 1e30

PREFIX = EVAL_PREFIX
VERSION_KEY = "eval_version"
EXAMPLES_KEY = "eval_examples"


@dataclass(frozen=True)
class ClientEvalReport:
    """One client's evaluation of one global version on its own test split."""

    client_id: str
    version: int
    examples: int
    metrics: dict[str, float]


def report_from_metrics(client_id: str, metrics: Mapping[str, float]) -> ClientEvalReport | None:
    """The evaluation report in an update's metrics, or None if it carries none (or a
    malformed one, which is logged and ignored: the update itself is still good)."""
    for k in metrics:  # a plain loop: a generator cost ~5 us on every update
        if k.startswith(PREFIX):
            break
    else:
        return None
    version, examples = metrics.get(VERSION_KEY, -1.0), metrics.get(EXAMPLES_KEY, 0.0)
    try:
        values = {k[len(PREFIX):]: float(v) for k, v in metrics.items()
                  if k.startswith(PREFIX) and k not in (VERSION_KEY, EXAMPLES_KEY)}
        good = (version >= 0 and math.isfinite(version) and version == int(version)
                and 1 <= examples <= MAX_NUM_EXAMPLES
                and all(math.isfinite(v) and abs(v) <= MAX_VALUE for v in values.values()))
    except (TypeError, ValueError, OverflowError):  # not numbers (an in-process caller)
        good = False
    if not good:
        log.warning("client %s sent a malformed evaluation report (version %r, %r examples, "
                    "non-finite or non-numeric values among %s); ignored, the update is "
                    "taken", client_id[:40], version, examples,
                    sorted(k for k in metrics if k.startswith(PREFIX))[:8])
        return None
    return ClientEvalReport(client_id, int(version), int(examples), values)


class ClientEvals:
    """Reports waiting for the next metrics row (owned by the core's loop thread)."""

    def __init__(self) -> None:
        self._reports: list[ClientEvalReport] = []

    def add(self, report: ClientEvalReport) -> None:
        self._reports.append(report)

    def discard(self, report: ClientEvalReport) -> None:
        """Take back a report whose update was refused after all."""
        try:
            self._reports.remove(report)
        except ValueError:
            pass

    def flush(self) -> dict[str, object]:
        """The row's client-evaluation fields for the reports since the last flush (none if
        there were none): per metric ``client_<m>_mean`` (weighted by test examples),
        ``client_<m>_min`` and ``client_<m>_max``."""
        reports, self._reports = self._reports, []
        return summarize(reports)


def summarize(reports: list[ClientEvalReport]) -> dict[str, object]:
    if not reports:
        return {}
    versions = [r.version for r in reports]
    row: dict[str, object] = {
        "client_eval_reports": len(reports),
        "client_eval_clients": len({r.client_id for r in reports}),
        "client_eval_examples": sum(r.examples for r in reports),
        "client_eval_versions": [min(versions), max(versions)],
    }
    names = sorted({k for r in reports for k in r.metrics})
    for name in names:
        have = [r for r in reports if name in r.metrics]
        total = sum(r.examples for r in have)
        values = [r.metrics[name] for r in have]
        row[f"client_{name}_mean"] = sum(r.metrics[name] * r.examples for r in have) / total
        row[f"client_{name}_min"] = min(values)
        row[f"client_{name}_max"] = max(values)
    return row


__all__ = ["ClientEvalReport", "ClientEvals", "report_from_metrics", "summarize"]
