"""What the dashboard shows, without any web code: a run's snapshot and its metric rows.

Two feeds give the same views:

* :class:`LiveFeed` — a running aggregator (or peer) *posts* a fresh snapshot (the dict of
  ``core.telemetry.snapshot()``) from its own event loop every half second; the dashboard only
  ever reads the last one posted, so it never touches the core and never waits for its loop.
* :class:`RunDirFeed` — a run directory, finished or still being written: the snapshot is
  built from ``summary.json``, the config it records and the last row of ``metrics.jsonl``.

Both read the rows by tailing ``metrics.jsonl`` (:class:`MetricsTail`): only the bytes added
since the last read, so a long run costs nothing per refresh. Refreshing (file reads) happens
on the dashboard's own thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["MAX_ROWS", "Feed", "LiveFeed", "MetricsTail", "RunDirFeed", "empty_snapshot",
           "post_snapshots", "snapshot_from_files"]

Snapshot = dict[str, Any]

#: Rows a feed keeps in memory (a run's first rows are dropped beyond this; the charts need no
#: more points than a screen has pixels, and ``/api/metrics?since=N`` says where it starts).
MAX_ROWS = 20_000
#: Bytes read from ``metrics.jsonl`` per refresh at most (a huge file is caught up over a few
#: refreshes rather than in one long read on the dashboard's loop).
READ_CHUNK = 4 << 20
#: One metrics line longer than this is skipped (a row is a few hundred bytes).
MAX_LINE = 1 << 20


class MetricsTail:
    """The rows of a ``metrics.jsonl`` that may still be growing.

    :meth:`read` appends the complete lines written since the last call (a torn last line
    waits for its end). A file that shrank or was replaced (a new run in the same directory)
    starts the rows over; :attr:`generation` counts such restarts so a page can reload.
    """

    def __init__(self, path: Path, *, max_rows: int = MAX_ROWS) -> None:
        self.path = path
        self.max_rows = max_rows
        self.rows: list[dict[str, Any]] = []
        #: Index (in the whole file) of ``rows[0]``: rows dropped from the front so far.
        self.first = 0
        self.generation = 0
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""

    @property
    def total(self) -> int:
        """Rows read so far, counting those dropped from memory."""
        return self.first + len(self.rows)

    def since(self, index: int) -> tuple[int, list[dict[str, Any]]]:
        """(index of the first row returned, rows from ``index`` on). An index before the
        rows held starts at the first one held."""
        start = min(max(index, self.first), self.total)
        return start, self.rows[start - self.first:]

    def read(self) -> int:
        """Read what was appended; returns the number of new rows."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return 0
        if (self._inode is not None and stat.st_ino != self._inode) or stat.st_size < self._offset:
            self._restart()
        self._inode = stat.st_ino
        if stat.st_size == self._offset:
            return 0
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(READ_CHUNK)
        except OSError:
            return 0
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > MAX_LINE:
            self._partial = b""  # not a row: drop it rather than hold it forever
        added = 0
        for line in lines:
            row = _parse(line)
            if row is not None:
                self.rows.append(row)
                added += 1
        if len(self.rows) > self.max_rows:
            drop = len(self.rows) - self.max_rows
            del self.rows[:drop]
            self.first += drop
        return added

    def _restart(self) -> None:
        self.rows, self.first, self._offset, self._partial = [], 0, 0, b""
        self.generation += 1


def _parse(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line or len(line) > MAX_LINE:
        return None
    try:  # NaN and Infinity (not JSON, but Python writes them) become null
        row = json.loads(line, parse_constant=lambda _: None)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


class Feed(Protocol):
    """What the web app reads. ``refresh`` runs on the dashboard's loop, once per tick."""

    run_dir: Path

    def refresh(self) -> None: ...

    def snapshot(self) -> Snapshot: ...

    @property
    def tail(self) -> MetricsTail: ...


def empty_snapshot(run_dir: Path | None = None, *, role: str = "server") -> Snapshot:
    """The snapshot's shape with nothing in it (before the first post, or an empty run)."""
    return {
        "role": role,
        "run": {"name": run_dir.name if run_dir else "", "dir": str(run_dir or ""),
                "mode": "", "rule": "", "started_unix": 0.0},
        "version": 0, "done": False, "clients_active": 0, "updates_total": 0,
        "refused_total": {}, "versions_total": 0, "bytes_in_total": {}, "bytes_out_total": 0,
        "staleness_hist": {}, "metrics": {}, "clients": [],
        "tier": {"workers": 0, "queue_depth": 0, "cold_starts": 0}, "peers": [],
    }


class LiveFeed:
    """The snapshots a running aggregator posts, and the rows of its ``metrics.jsonl``.

    :meth:`post` may be called from any thread (it swaps one reference under a lock);
    everything else runs on the dashboard's thread.
    """

    def __init__(self, run_dir: str | Path, *, source: str = "live") -> None:
        self.run_dir = Path(run_dir)
        self.source = source
        self._tail = MetricsTail(self.run_dir / "metrics.jsonl")
        self._lock = threading.Lock()
        self._posted: Snapshot | None = None
        self._posted_at = 0.0

    @property
    def tail(self) -> MetricsTail:
        return self._tail

    def post(self, snapshot: Snapshot) -> None:
        """Hand over a new snapshot (any thread). It must not be changed afterwards."""
        with self._lock:
            self._posted, self._posted_at = snapshot, time.monotonic()

    def refresh(self) -> None:
        self._tail.read()

    def snapshot(self) -> Snapshot:
        with self._lock:
            posted, at = self._posted, self._posted_at
        if posted is None:
            snap = empty_snapshot(self.run_dir)
            snap["source"] = "waiting"
            return snap
        return {**posted, "source": self.source,
                "posted_s_ago": round(time.monotonic() - at, 3)}


async def post_snapshots(feed: LiveFeed, snapshot: Callable[[], Snapshot], *,
                         every_s: float = 0.5) -> None:
    """Until cancelled: post ``snapshot()`` to ``feed`` every ``every_s`` seconds.

    Run it as a task on the event loop that owns the core (the only thread that may read it);
    the call is the telemetry's own (a dict of counters), and handing it over is a swap.
    A failing snapshot is skipped, never raised into the server's loop.
    """
    failures = 0
    while True:
        try:
            feed.post(snapshot())
        except Exception:  # a telemetry bug must not stop the server
            failures += 1
            if failures == 1:  # once: it would fail the same way twice a second
                log.exception("dashboard: the snapshot failed; the page shows the last one")
        await asyncio.sleep(every_s)


class RunDirFeed:
    """A run directory as the dashboard shows it: rows tailed, the snapshot from the files."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._tail = MetricsTail(self.run_dir / "metrics.jsonl")
        self._summary: dict[str, Any] | None = None
        self._summary_key: tuple[int, int] | None = None

    @property
    def tail(self) -> MetricsTail:
        return self._tail

    def refresh(self) -> None:
        self._tail.read()
        path = self.run_dir / "summary.json"
        try:
            stat = path.stat()
        except OSError:
            self._summary, self._summary_key = None, None
            return
        key = (stat.st_mtime_ns, stat.st_size)
        if key != self._summary_key and stat.st_size < 16 << 20:
            try:
                summary = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return  # being written: try again at the next refresh
            self._summary = summary if isinstance(summary, dict) else None
            self._summary_key = key

    def snapshot(self) -> Snapshot:
        rows = self._tail.rows
        snap = snapshot_from_files(self.run_dir, rows[-1] if rows else {}, self._summary,
                                   metrics_mtime=_mtime(self._tail.path),
                                   summary_mtime=_mtime(self.run_dir / "summary.json"))
        snap["source"] = "files"
        return snap


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _num(value: Any, default: float = 0) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return value if not (isinstance(value, float) and not math.isfinite(value)) else default


def _table(parent: dict[str, Any], key: str) -> dict[str, Any]:
    value = parent.get(key)
    return value if isinstance(value, dict) else {}


def snapshot_from_files(run_dir: Path, last: dict[str, Any], summary: dict[str, Any] | None,
                        *, metrics_mtime: float | None = None,
                        summary_mtime: float | None = None) -> Snapshot:
    """The live snapshot's fields that a run's files hold: counters from the last row, the
    mode and rule from the config the summary records. Per-client details are live only."""
    config = _table(summary or {}, "config")
    gossip = "gossip" in config
    snap = empty_snapshot(run_dir, role="peer" if gossip else "server")
    server = _table(config, "server")
    if gossip:
        mode, rule = "gossip", str(_table(config, "gossip").get("rule", ""))
    else:
        mode, rule = str(server.get("mode", "")), str(server.get("defense", ""))
    train = _table(server, "train")
    version = int(_num(last.get("version", (summary or {}).get("versions", 0))))
    # finished: the summary is written after the last row (a resumed run appends again)
    done = summary is not None and (metrics_mtime is None or summary_mtime is None
                                    or summary_mtime >= metrics_mtime)
    started = 0.0
    if metrics_mtime is not None:
        started = metrics_mtime - float(_num(last.get("time_s"), 0.0))
    refused = last.get("refused_by_reason") or (summary or {}).get("refused_by_reason") or {}
    snap.update({
        "version": version, "versions_total": version, "done": done,
        "clients_active": int(_num(last.get("clients", last.get("peers", 0)))),
        "updates_total": int(_num(last.get("updates", 0))),
        "refused_total": {str(k): int(_num(v)) for k, v in refused.items()}
        if isinstance(refused, dict) else {},
        "bytes_in_total": {str(train.get("codec", "all")): int(_num(last.get("bytes_up", 0)))},
        "bytes_out_total": int(_num(last.get("bytes_down", 0))),
        "metrics": dict(last),
        "tier": {"workers": int(_num(last.get("workers", 0))),
                 "queue_depth": int(_num(last.get("queue", 0))),
                 "cold_starts": int(_num(last.get("cold_starts", 0)))},
    })
    snap["run"].update({"mode": mode, "rule": rule, "started_unix": started})
    return snap
