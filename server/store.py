"""Durable aggregator state (:class:`SqliteState`, the durable backend of
:class:`~murmura.server.state.AggregatorState`): one SQLite database (WAL) and a payload spool,
in the run's output directory, written by one store thread with group commit.

What it keeps, so that a ``kill -9`` loses no acknowledged update and counts none twice:

* ``sessions``: joined clients, so they carry on after a restart with their sessions;
* ``seen``: every counted ``(client_id, update_id)`` with its staleness, so a push retried
  after a restart answers "duplicate" instead of being counted again;
* ``pending``: updates acknowledged but not yet part of a published version, as their header
  and the raw payload (appended to a spool segment file, or, under :data:`INLINE_MAX_BYTES`,
  a row of ``inline`` written in the same commit as the pending row, so a group of small
  updates costs one fsync instead of two); a restart decodes them again and hands them to the
  policy in their original order;
* ``versions``: the metrics row of every published version, with the checkpoint file it made
  current; ``metrics.jsonl`` is written from these rows, so it never holds a version twice;
* ``meta``: the counters (updates, bytes, refusals, elapsed time) and the current version.

Publishing is one transaction: the version's row, the checkpoint name it makes current and the
deletion of the pending rows it consumed commit together (the checkpoint file, named after its
version, is on disk before). A crash leaves either the old version with its pending updates or
the new one without them.

Durability never blocks the event loop: callers get a :class:`~concurrent.futures.Future` that
resolves once the operation is on disk. The store thread takes every operation queued while it
was busy and covers them with one spool ``fsync`` and one SQLite commit (group commit).

The payload spool (segment files, direct writes, rotation, the writer thread) is
:class:`~murmura.server.spool.Spool`, which this class owns: the store thread calls its ``sync``
first in every group commit, so the bytes and the file's size are durable before the rows that
point at them.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import queue
import sqlite3
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from murmura.server.futures import settle
from murmura.server.spool import (
    BOUNCE_BYTES,
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    SEGMENT_BYTES,
    Spool,
    fsync_dir,
)
from murmura.server.state import (
    AggregatorState,
    Consume,
    DropPush,
    DuplicateUpdate,
    EndSession,
    Op,
    PendingUpdate,
    PublishVersion,
    RecordPush,
    SaveSession,
    SpoolRef,
    StoredState,
    Touch,
)

log = logging.getLogger(__name__)

DB_NAME = "state.db"
LOCK_NAME = "state.lock"
SPOOL_DIR = "spool"
#: Payloads smaller than this are kept in the database (table ``inline``), committed with
#: their pending row, instead of in a spool segment that needs an fsync of its own.
INLINE_MAX_BYTES = 64 << 10
#: The segment number of a :class:`SpoolRef` into ``inline`` (its offset is the row's id).
INLINE_SEGMENT = -1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (session TEXT PRIMARY KEY, client_id TEXT NOT NULL,
    profile TEXT NOT NULL, joined_at REAL NOT NULL, public_key BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS seen (n INTEGER PRIMARY KEY AUTOINCREMENT, client_id TEXT NOT NULL,
    update_id TEXT NOT NULL, staleness INTEGER NOT NULL, UNIQUE (client_id, update_id));
CREATE TABLE IF NOT EXISTS pending (seq INTEGER PRIMARY KEY, client_id TEXT NOT NULL,
    header TEXT NOT NULL, staleness INTEGER NOT NULL, segment INTEGER NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS versions (version INTEGER PRIMARY KEY, row TEXT NOT NULL,
    checkpoint TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inline (id INTEGER PRIMARY KEY, data BLOB NOT NULL);
"""


@dataclass
class _Job:
    op: Op                            # a state operation
    counters: dict[str, Any] | None   # the counters as of this job (the newest is written)
    future: Future[Any]
    publishes: bool = False           # a version commit: spool segments may be freed after


class SqliteState(AggregatorState):
    """The durable state of one aggregator run in ``out_dir`` (see the module docstring)."""

    durable = True

    def __init__(self, out_dir: str | Path, *, seen_limit: int = 100_000) -> None:
        super().__init__(seen_limit=seen_limit)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / DB_NAME
        self.spool_dir = self.dir / SPOOL_DIR
        # Its own writer thread copies payloads out while the store thread waits on an fsync
        # or a commit.
        self._spool = Spool(self.spool_dir)
        # One server per directory: a second one would interleave its state with ours. The
        # kernel drops the lock with the process, also on kill -9.
        self._lock_file = open(self.dir / LOCK_NAME, "a")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ValueError(f"another murmura server is using {self.dir}; stop it first or "
                             f"choose another --out") from None
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        self._conn.executescript(_SCHEMA)
        # ids of inline payloads: never one of a past life's rows that are still pending
        (last,) = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM inline").fetchone()
        self._inline_ids = itertools.count(int(last) + 1)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: Group commits done, and operations they covered (the benchmark reports both).
        self.commits = 0
        self.committed_ops = 0

    # -- start-up -----------------------------------------------------------------------------

    def load(self) -> StoredState:
        """Read everything back (before the store thread starts writing)."""
        c = self._conn
        meta = dict(c.execute("SELECT key, value FROM meta").fetchall())
        state = StoredState(version=int(meta.get("version", 0)),
                            checkpoint=meta.get("checkpoint", ""),
                            counters=json.loads(meta.get("counters", "{}")))
        state.sessions = [(s, cid, json.loads(p), t, bytes(k)) for s, cid, p, t, k in
                          c.execute("SELECT session, client_id, profile, joined_at, public_key "
                                    "FROM sessions")]
        state.seen = [tuple(r) for r in c.execute(  # type: ignore[misc]
            "SELECT client_id, update_id, staleness FROM seen ORDER BY n DESC LIMIT ?",
            (self.seen_limit,))][::-1]
        state.pending = [PendingUpdate(seq, cid, json.loads(h), st, SpoolRef(sg, off, n))
                         for seq, cid, h, st, sg, off, n in c.execute(
                             "SELECT seq, client_id, header, staleness, segment, offset, length "
                             "FROM pending ORDER BY seq")]
        state.rows = [json.loads(r) for (r,) in
                      c.execute("SELECT row FROM versions ORDER BY version")]
        self._spool.resume()  # never append to a segment of a past life
        self._spool.free(self._pending_segments())
        return state

    @property
    def direct_bytes(self) -> int:
        """Spooled payload bytes written with ``O_DIRECT`` (tests, benchmarks)."""
        return self._spool.direct_bytes

    @property
    def buffered_bytes(self) -> int:
        """Spooled payload bytes written through the page cache (tests, benchmarks)."""
        return self._spool.buffered_bytes

    def read_payload(self, ref: SpoolRef) -> bytes:
        """A spooled payload's bytes (start-up replay, a version rebuilt from its updates)."""
        if ref.segment == INLINE_SEGMENT:
            if ref.data is not None:
                # A reference that still carries its bytes may be read before the group commit
                # that writes them has run (a damaged partial rebuilt at once): they are the
                # bytes that commit writes.
                return ref.data
            row = self._conn.execute("SELECT data FROM inline WHERE id = ?",
                                     (ref.offset,)).fetchone()
            if row is None or len(row[0]) != ref.length:
                raise ValueError(f"no inline payload of {ref.length} bytes with id {ref.offset}")
            return bytes(row[0])
        return self._spool.read(ref)

    # -- writing ------------------------------------------------------------------------------

    def spool(self, data: memoryview | bytes) -> Future[SpoolRef]:
        """Append a payload to the spool (written, not yet fsynced: the commit of the update
        that refers to it syncs it first). ``data`` is not referenced once the future is done.

        A payload under :data:`INLINE_MAX_BYTES` is copied into its reference instead, and
        written with the operation that records it (one commit, one fsync)."""
        view = memoryview(data).cast("B")
        if len(view) < INLINE_MAX_BYTES:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the state store is closed")
                ident = next(self._inline_ids)
            done: Future[SpoolRef] = Future()
            done.set_result(SpoolRef(INLINE_SEGMENT, ident, len(view),
                                     data=data if isinstance(data, bytes) else bytes(view)))
            return done
        with self._lock:
            if self._closed:
                raise RuntimeError("the state store is closed")
            return self._spool.write(view)

    def submit(self, op: Op, *, counters: dict[str, Any] | None = None,
               publishes: bool = False) -> Future[None]:
        """Apply ``op`` in the next group commit; the future is done once it is on disk (or
        holds the error; then nothing of its group was committed)."""
        return self._submit(_Job(op, counters, Future(), publishes=publishes))

    def _submit(self, job: _Job) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the state store is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="murmura-store",
                                                daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return job.future

    # -- operations (run on the store thread, inside the group's transaction) -----------------

    def _apply(self, c: sqlite3.Connection, op: Op) -> None:
        if isinstance(op, SaveSession):
            if op.replaces:
                c.execute("DELETE FROM sessions WHERE session = ?", (op.replaces,))
            c.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)",
                      (op.session, op.client_id, json.dumps(op.profile), op.joined_at,
                       op.public_key))
        elif isinstance(op, EndSession):
            c.execute("DELETE FROM sessions WHERE session = ?", (op.session,))
        elif isinstance(op, RecordPush):
            try:
                c.execute("INSERT INTO seen (client_id, update_id, staleness) VALUES (?, ?, ?)",
                          (op.client_id, op.update_id, op.staleness))
            except sqlite3.IntegrityError:
                raise DuplicateUpdate(f"update {op.update_id!r} of {op.client_id!r} is already "
                                      "counted") from None
            ref = op.ref
            c.execute("INSERT INTO pending VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (op.seq, op.client_id, json.dumps(op.header), op.staleness, ref.segment,
                       ref.offset, ref.length))
            if ref.segment == INLINE_SEGMENT:
                if ref.data is None or len(ref.data) != ref.length:
                    raise ValueError(f"inline spool reference {ref} without its payload")
                c.execute("INSERT INTO inline VALUES (?, ?)", (ref.offset, ref.data))
            c.execute("DELETE FROM seen WHERE n <= (SELECT MAX(n) FROM seen) - ?",
                      (self.seen_limit,))
        elif isinstance(op, DropPush):
            _forget_pending(c, (op.seq,))
            c.execute("DELETE FROM seen WHERE client_id = ? AND update_id = ?",
                      (op.client_id, op.update_id))
        elif isinstance(op, Consume):
            _forget_pending(c, op.seqs)
        elif isinstance(op, PublishVersion):
            c.execute("INSERT INTO versions VALUES (?, ?, ?)",
                      (op.version, json.dumps(op.row, sort_keys=True), op.checkpoint))
            _forget_pending(c, op.seqs)
            c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                          [("version", str(op.version)), ("checkpoint", op.checkpoint)])
        elif not isinstance(op, Touch):
            raise TypeError(f"not a state operation: {op!r}")

    # -- the store thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            first = self._jobs.get()
            batch = [first]
            while True:
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            commits = [job for job in batch if job is not None]
            if commits:
                self._commit(commits)
            if stop:
                return

    def _commit(self, jobs: list[_Job]) -> None:
        c = self._conn
        if self.before_commit is not None:
            self.before_commit()  # tests: hold a commit while its waiters are cancelled
        try:
            self._spool.sync()  # payloads before the rows that point at them
            c.execute("BEGIN IMMEDIATE")
            try:
                for job in jobs:
                    self._apply(c, job.op)
                counters = next((j.counters for j in reversed(jobs) if j.counters is not None),
                                None)
                if counters is not None:
                    c.execute("INSERT OR REPLACE INTO meta VALUES ('counters', ?)",
                              (json.dumps(counters, sort_keys=True),))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        except BaseException as exc:  # noqa: BLE001 - every waiter learns it
            log.error("state commit failed; %d operations were not made durable: %s",
                      len(jobs), exc)
            for job in jobs:
                settle(job.future, exc=exc)
            return
        self.commits += 1
        self.committed_ops += len(jobs)
        for job in jobs:  # a waiter that went away leaves a cancelled future: skip it
            settle(job.future)
        if any(j.publishes for j in jobs):
            try:
                self._spool.free(self._pending_segments())
            except OSError as exc:
                log.warning("could not remove consumed spool segments: %s", exc)

    def _pending_segments(self) -> set[int]:
        """The spool segments that pending updates still point into."""
        return {s for (s,) in self._conn.execute("SELECT DISTINCT segment FROM pending")}

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued operations, then stop the thread and close the files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_threads(timeout)
        self._conn.close()
        self._lock_file.close()

    def _stop_threads(self, timeout: float | None) -> None:
        self._spool.stop(timeout)  # its writes first: queued commits may point at them
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
        self._spool.close()  # after the store thread's last sync

    def abandon(self) -> None:
        """Tests: stop as a killed process would, dropping what is queued and not committed."""
        with self._lock:
            self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                settle(job.future, exc=RuntimeError("the store was abandoned"))
        self._spool.drop_queued("the store was abandoned")
        self._stop_threads(10)
        self._conn.close()
        self._lock_file.close()


def _forget_pending(c: sqlite3.Connection, seqs: tuple[int, ...]) -> None:
    """Delete pending rows, and the inline payloads they point at."""
    c.executemany("DELETE FROM inline WHERE id IN (SELECT offset FROM pending WHERE seq = ? "
                  "AND segment = ?)", [(s, INLINE_SEGMENT) for s in seqs])
    c.executemany("DELETE FROM pending WHERE seq = ?", [(s,) for s in seqs])


#: The name the durable backend had before the state interface; kept for callers.
StateStore = SqliteState

# The spool's constants and fsync_dir are re-exported: callers and tests import them from here.
__all__ = ["BOUNCE_BYTES", "DB_NAME", "DIRECT_ALIGN", "DIRECT_MIN_BYTES", "INLINE_MAX_BYTES",
           "INLINE_SEGMENT", "SEGMENT_BYTES", "PendingUpdate", "SpoolRef", "SqliteState",
           "StateStore", "StoredState", "fsync_dir"]
