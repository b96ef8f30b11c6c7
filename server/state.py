"""The aggregator's state behind one interface, and its in-memory backend.

What an aggregator must keep so that a restart loses no acknowledged update and counts none
twice: joined sessions, the counted ``(client id, update id)`` pairs, the updates acknowledged
but not yet part of a published version (their header and raw payload, in a spool), the metrics
row of every published version with the checkpoint it made current, and the counters.

:class:`AggregatorState` is that interface. The core changes it only through operations
(:data:`Op`: plain data, built on the caller's thread) handed to :meth:`AggregatorState.submit`,
which returns a future that is done once the operation is kept; :meth:`AggregatorState.load`
reads everything back at start-up. Two backends implement it and one contract suite
(``tests/server/test_state_contract.py``) runs against both, in the shape of Flower's
``LinkState`` and its ``StateTest``:

* :class:`MemoryState` here: dictionaries, every operation kept at once. It outlives an
  aggregator object, not the process: a simulation or a test can restart an aggregator over it.
* :class:`~murmura.server.store.SqliteState`: SQLite (WAL) and spool files in the run's output
  directory, group commit on a store thread; it survives ``kill -9``.

A batch of operations is all or nothing in both: an operation that fails (a pair counted
twice) fails its whole group, and the state is as it was before the group.
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["AggregatorState", "Consume", "DropPush", "EndSession", "MemoryState", "Op",
           "PendingUpdate", "PublishVersion", "RecordPush", "SaveSession", "SpoolRef",
           "StoredState", "Touch"]


@dataclass(frozen=True)
class SpoolRef:
    """Where a payload lies in the spool: segment number, byte offset, length.

    A backend may keep a small payload with the operation that records it instead of in a
    spool file (``SqliteState`` stores it in its database, in the same commit as the pending
    row): its reference then carries the bytes in ``data`` until that operation is kept. The
    bytes are not part of the reference's identity.
    """

    segment: int
    offset: int
    length: int
    data: bytes | None = field(default=None, compare=False, repr=False)


@dataclass
class PendingUpdate:
    """An acknowledged update not yet in a published version."""

    seq: int
    client_id: str
    header: dict[str, Any]
    staleness: int
    ref: SpoolRef


@dataclass
class StoredState:
    """What the state held when it was opened (read once at start-up)."""

    version: int = 0
    checkpoint: str = ""
    counters: dict[str, Any] = field(default_factory=dict)
    #: (session, client id, profile, joined_at, the Ed25519 key proven at Join or b"")
    sessions: list[tuple[str, str, dict[str, Any], float, bytes]] = field(default_factory=list)
    #: counted (client id, update id, staleness), oldest first, at most ``seen_limit``
    seen: list[tuple[str, str, int]] = field(default_factory=list)
    pending: list[PendingUpdate] = field(default_factory=list)
    #: the metrics row of every published version, in version order
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.version or self.sessions or self.seen or self.pending or self.counters)


# -- operations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveSession:
    """A client joined (``replaces``: the session it had before, which ends)."""

    session: str
    client_id: str
    profile: dict[str, Any]
    joined_at: float
    public_key: bytes = b""
    replaces: str | None = None


@dataclass(frozen=True)
class EndSession:
    session: str


@dataclass(frozen=True)
class RecordPush:
    """An update was counted: its pair is seen, and it is pending until a version uses it."""

    seq: int
    client_id: str
    update_id: str
    header: dict[str, Any]
    staleness: int
    ref: SpoolRef


@dataclass(frozen=True)
class DropPush:
    """Undo :class:`RecordPush` of an update the policy refused after all."""

    seq: int
    client_id: str
    update_id: str


@dataclass(frozen=True)
class Consume:
    """Forget pending updates whose aggregate was dropped (no version was made)."""

    seqs: tuple[int, ...]


@dataclass(frozen=True)
class PublishVersion:
    """``version`` is published: its row, its checkpoint made current, its updates used."""

    version: int
    row: dict[str, Any]
    checkpoint: str
    seqs: tuple[int, ...]


@dataclass(frozen=True)
class Touch:
    """Changes nothing: submitted with ``counters`` to keep the counters alone."""


Op = SaveSession | EndSession | RecordPush | DropPush | Consume | PublishVersion | Touch


class DuplicateUpdate(ValueError):
    """A :class:`RecordPush` for a pair that is already counted."""


# -- the interface -------------------------------------------------------------------------------


class AggregatorState(ABC):
    """An aggregator's state (see the module docstring)."""

    #: Whether the state survives the process (a crash of the machine included).
    durable: ClassVar[bool]

    def __init__(self, *, seen_limit: int = 100_000) -> None:
        if seen_limit < 1:
            raise ValueError(f"seen_limit must be >= 1, got {seen_limit}")
        self.seen_limit = seen_limit
        #: Tests: called before each group of operations is kept (to hold one back).
        self.before_commit: Callable[[], None] | None = None

    @abstractmethod
    def load(self) -> StoredState:
        """Everything the state holds, read back (at start-up, before any :meth:`submit`)."""

    @abstractmethod
    def read_payload(self, ref: SpoolRef) -> bytes:
        """A spooled payload's bytes (for replaying pending updates at start-up)."""

    @abstractmethod
    def spool(self, data: memoryview | bytes) -> Future[SpoolRef]:
        """Keep a payload; the future gives where. It is kept for good once an operation
        that refers to it is (``data`` is not referenced after the future is done)."""

    @abstractmethod
    def submit(self, op: Op, *, counters: dict[str, Any] | None = None,
               publishes: bool = False) -> Future[None]:
        """Apply ``op`` (and keep ``counters``, when given); the future is done once it is
        kept, or holds the error, and then nothing of its group was applied. ``publishes``
        marks a version's commit, after which consumed payloads may be freed."""

    @abstractmethod
    def close(self, timeout: float | None = 30.0) -> None:
        """Finish what was submitted, then refuse further operations."""

    @abstractmethod
    def abandon(self) -> None:
        """Tests: stop as a killed process would, dropping what is not yet kept."""


# -- the in-memory backend -----------------------------------------------------------------------


class _Tables:
    """What a :class:`MemoryState` holds; shared by the states reopened over it."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}
        self.sessions: dict[str, tuple[str, dict[str, Any], float, bytes]] = {}
        self.seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.pending: dict[int, PendingUpdate] = {}
        self.versions: dict[int, tuple[dict[str, Any], str]] = {}
        self.payloads: dict[int, bytes] = {}   # spool offset -> bytes
        self.spooled = 0                       # next spool offset
        self.lock = threading.Lock()


class MemoryState(AggregatorState):
    """The state in dictionaries: every operation is kept when :meth:`submit` returns.

    :meth:`reopened` gives a new state over the same tables, as a restarted aggregator in the
    same process would open its directory again.
    """

    durable = False

    def __init__(self, *, seen_limit: int = 100_000, _tables: _Tables | None = None) -> None:
        super().__init__(seen_limit=seen_limit)
        self._t = _tables if _tables is not None else _Tables()
        self._closed = False

    def reopened(self) -> MemoryState:
        """A new state over the same tables (this one should be closed or abandoned)."""
        return MemoryState(seen_limit=self.seen_limit, _tables=self._t)

    def load(self) -> StoredState:
        t = self._t
        with t.lock:
            seen = list(t.seen.items())[-self.seen_limit:]
            return StoredState(
                version=int(t.meta.get("version", 0)),
                checkpoint=str(t.meta.get("checkpoint", "")),
                counters=copy.deepcopy(t.meta.get("counters", {})),
                sessions=[(s, cid, copy.deepcopy(p), at, key)
                          for s, (cid, p, at, key) in t.sessions.items()],
                seen=[(cid, uid, st) for (cid, uid), st in seen],
                pending=[copy.deepcopy(t.pending[s]) for s in sorted(t.pending)],
                rows=[copy.deepcopy(t.versions[v][0]) for v in sorted(t.versions)])

    def read_payload(self, ref: SpoolRef) -> bytes:
        data = self._t.payloads.get(ref.offset)
        if data is None or len(data) != ref.length:
            raise ValueError(f"no spooled payload at {ref}")
        return data

    def spool(self, data: memoryview | bytes) -> Future[SpoolRef]:
        self._check_open()
        t = self._t
        with t.lock:
            offset = t.spooled
            t.payloads[offset] = bytes(data)
            t.spooled += max(len(t.payloads[offset]), 1)
        fut: Future[SpoolRef] = Future()
        fut.set_result(SpoolRef(0, offset, len(t.payloads[offset])))
        return fut

    def submit(self, op: Op, *, counters: dict[str, Any] | None = None,
               publishes: bool = False) -> Future[None]:
        self._check_open()
        if self.before_commit is not None:
            self.before_commit()
        fut: Future[None] = Future()
        t = self._t
        with t.lock:
            try:
                self._apply(op)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as a backend must
                fut.set_exception(exc)
                return fut
            if counters is not None:
                t.meta["counters"] = copy.deepcopy(counters)
            if publishes:  # payloads no pending update refers to any more
                used = {p.ref.offset for p in t.pending.values()}
                for offset in [o for o in t.payloads if o not in used]:
                    del t.payloads[offset]
        fut.set_result(None)
        return fut

    def _apply(self, op: Op) -> None:
        """One operation, all or nothing (checked before anything changes)."""
        t = self._t
        if isinstance(op, SaveSession):
            if op.replaces:
                t.sessions.pop(op.replaces, None)
            t.sessions[op.session] = (op.client_id, copy.deepcopy(op.profile), op.joined_at,
                                      bytes(op.public_key))
        elif isinstance(op, EndSession):
            t.sessions.pop(op.session, None)
        elif isinstance(op, RecordPush):
            key = (op.client_id, op.update_id)
            if key in t.seen:
                raise DuplicateUpdate(f"update {op.update_id!r} of {op.client_id!r} is "
                                      "already counted")
            if op.seq in t.pending:
                raise ValueError(f"pending update {op.seq} exists already")
            t.seen[key] = op.staleness
            while len(t.seen) > self.seen_limit:
                t.seen.popitem(last=False)
            t.pending[op.seq] = PendingUpdate(op.seq, op.client_id, copy.deepcopy(op.header),
                                              op.staleness, op.ref)
        elif isinstance(op, DropPush):
            t.pending.pop(op.seq, None)
            t.seen.pop((op.client_id, op.update_id), None)
        elif isinstance(op, Consume):
            for seq in op.seqs:
                t.pending.pop(seq, None)
        elif isinstance(op, PublishVersion):
            if op.version in t.versions:
                raise ValueError(f"version {op.version} is published already")
            t.versions[op.version] = (copy.deepcopy(op.row), op.checkpoint)
            for seq in op.seqs:
                t.pending.pop(seq, None)
            t.meta["version"], t.meta["checkpoint"] = op.version, op.checkpoint
        elif not isinstance(op, Touch):
            raise TypeError(f"not a state operation: {op!r}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the aggregator state is closed")

    def close(self, timeout: float | None = 30.0) -> None:
        self._closed = True

    def abandon(self) -> None:
        self._closed = True  # nothing is ever queued: every submitted operation was kept
