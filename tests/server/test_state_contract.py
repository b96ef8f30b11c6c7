"""The aggregator state's contract, run against every backend (in memory and SQLite).

Each backend comes with a way to restart over what it kept (``reopen``: a clean restart;
``crash``: as a killed process, dropping what was not yet kept). The suite writes through the
interface, restarts, and checks what ``load`` gives back: what a restarted aggregator
resumes from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from murmura.server.state import (
    AggregatorState,
    Consume,
    DropPush,
    DuplicateUpdate,
    EndSession,
    MemoryState,
    PublishVersion,
    RecordPush,
    SaveSession,
    SpoolRef,
    Touch,
)
from murmura.server.store import SqliteState


@dataclass
class Backend:
    state: AggregatorState
    #: close (or kill) the state and open a new one over what it kept
    restart: Callable[[AggregatorState, bool], AggregatorState]


def _memory(tmp_path: Path, seen_limit: int) -> Backend:
    def restart(state: AggregatorState, crash: bool) -> AggregatorState:
        assert isinstance(state, MemoryState)
        state.abandon() if crash else state.close()
        return state.reopened()
    return Backend(MemoryState(seen_limit=seen_limit), restart)


def _sqlite(tmp_path: Path, seen_limit: int) -> Backend:
    def restart(state: AggregatorState, crash: bool) -> AggregatorState:
        state.abandon() if crash else state.close()
        return SqliteState(tmp_path, seen_limit=seen_limit)
    return Backend(SqliteState(tmp_path, seen_limit=seen_limit), restart)


BACKENDS = {"memory": _memory, "sqlite": _sqlite}


@pytest.fixture(params=sorted(BACKENDS))
def make(request, tmp_path) -> Iterator[Callable[..., Backend]]:
    made: list[Backend] = []

    def build(seen_limit: int = 100_000) -> Backend:
        backend = BACKENDS[request.param](tmp_path, seen_limit)
        made.append(backend)
        return backend
    yield build
    for backend in made:
        backend.state.close()


def push(state: AggregatorState, seq: int, client: str, payload: bytes, *,
         staleness: int = 0, update_id: str | None = None) -> RecordPush:
    ref = state.spool(payload).result(10)
    op = RecordPush(seq, client, update_id or f"u{seq}", {"codec": "dense-f32", "n": seq},
                    staleness, ref)
    state.submit(op).result(10)
    return op


def reopen(backend: Backend, *, crash: bool = False) -> AggregatorState:
    backend.state = backend.restart(backend.state, crash)
    return backend.state


def test_a_new_state_is_empty(make) -> None:
    state = make().state
    loaded = state.load()
    assert loaded.empty and loaded.version == 0 and loaded.rows == []


def test_sessions_are_kept_replaced_and_ended(make) -> None:
    backend = make()
    state = backend.state
    for op in (SaveSession("s1", "alice", {"device": "cpu"}, 1.0),
               SaveSession("s2", "bob", {"device": "cuda"}, 2.0, public_key=b"\x01" * 32),
               SaveSession("s3", "alice", {"device": "cpu"}, 3.0, replaces="s1"),
               EndSession("s2")):
        state.submit(op).result(10)
    sessions = reopen(backend).load().sessions
    assert sessions == [("s3", "alice", {"device": "cpu"}, 3.0, b"")]


def test_a_spooled_payload_reads_back_before_the_commit_that_records_it(make) -> None:
    """A version rebuilt from its updates' spooled payloads may read one whose pending row
    is still waiting for its group commit (a small one kept in the database included)."""
    state = make().state
    for payload in (b"small", bytes(range(256)) * 400):  # inline, and a spool file's
        ref = state.spool(payload).result(10)
        assert state.read_payload(ref) == payload


def test_a_pushed_update_is_pending_with_its_payload_and_seen(make) -> None:
    backend = make()
    push(backend.state, 1, "alice", b"payload-one", staleness=2)
    state = reopen(backend)
    loaded = state.load()
    (pending,) = loaded.pending
    assert (pending.seq, pending.client_id, pending.staleness) == (1, "alice", 2)
    assert pending.header == {"codec": "dense-f32", "n": 1}
    assert state.read_payload(pending.ref) == b"payload-one"
    assert loaded.seen == [("alice", "u1", 2)]


def test_pending_updates_come_back_in_order_and_drop_undoes_a_push(make) -> None:
    backend = make()
    state = backend.state
    for seq in (1, 2, 3):
        push(state, seq, f"c{seq}", bytes([seq]) * 10)
    state.submit(DropPush(2, "c2", "u2")).result(10)
    loaded = reopen(backend).load()
    assert [p.seq for p in loaded.pending] == [1, 3]
    assert [s[:2] for s in loaded.seen] == [("c1", "u1"), ("c3", "u3")]


def test_a_published_version_consumes_its_updates_atomically(make) -> None:
    backend = make()
    state = backend.state
    for seq in (1, 2, 3):
        push(state, seq, "alice", b"x" * 100)
    state.submit(PublishVersion(1, {"version": 1, "loss": 0.5}, "versions/v1.npz", (1, 2)),
                 publishes=True).result(10)
    state.submit(Consume((3,)), publishes=True).result(10)
    push(state, 4, "bob", b"y" * 100)
    state.submit(PublishVersion(2, {"version": 2, "loss": 0.25}, "versions/v2.npz", (4,)),
                 publishes=True).result(10)
    state = reopen(backend)
    loaded = state.load()
    assert (loaded.version, loaded.checkpoint) == (2, "versions/v2.npz")
    assert loaded.rows == [{"version": 1, "loss": 0.5}, {"version": 2, "loss": 0.25}]
    assert loaded.pending == []
    assert len(loaded.seen) == 4  # used updates stay counted: a retry is still a duplicate


def test_the_latest_counters_are_kept(make) -> None:
    backend = make()
    state = backend.state
    state.submit(Touch(), counters={"updates": 1, "refused": {}}).result(10)
    state.submit(Touch(), counters={"updates": 7, "refused": {"INVALID_ARGUMENT": 2}}).result(10)
    state.submit(EndSession("nobody")).result(10)  # no counters: the last ones stay
    assert reopen(backend).load().counters == {"updates": 7,
                                               "refused": {"INVALID_ARGUMENT": 2}}


def test_seen_keeps_the_newest_pairs_within_its_limit(make) -> None:
    backend = make(seen_limit=3)
    for seq in range(1, 6):
        push(backend.state, seq, "alice", b"z", staleness=seq)
    loaded = reopen(backend).load()
    assert loaded.seen == [("alice", "u3", 3), ("alice", "u4", 4), ("alice", "u5", 5)]


def test_a_pair_counted_twice_is_refused_and_changes_nothing(make) -> None:
    backend = make()
    state = backend.state
    push(state, 1, "alice", b"first", update_id="same")
    ref = state.spool(b"second").result(10)
    with pytest.raises(DuplicateUpdate):
        state.submit(RecordPush(2, "alice", "same", {}, 0, ref)).result(10)
    loaded = reopen(backend).load()
    assert [p.seq for p in loaded.pending] == [1] and len(loaded.seen) == 1


def test_what_was_kept_survives_a_crash(make) -> None:
    backend = make()
    state = backend.state
    push(state, 1, "alice", b"kept")
    state.submit(SaveSession("s1", "alice", {}, 1.0)).result(10)
    state = reopen(backend, crash=True)
    loaded = state.load()
    assert [p.seq for p in loaded.pending] == [1] and loaded.sessions[0][0] == "s1"
    assert state.read_payload(loaded.pending[0].ref) == b"kept"


def test_a_closed_state_refuses_work(make) -> None:
    state = make().state
    state.close()
    with pytest.raises(RuntimeError, match="closed"):
        state.submit(Touch())
    with pytest.raises(RuntimeError, match="closed"):
        state.spool(b"late")


def test_the_backends_are_the_interface(make) -> None:
    backend = make()
    assert isinstance(backend.state, AggregatorState)
    assert backend.state.durable is isinstance(backend.state, SqliteState)
    with pytest.raises(TypeError):
        backend.state.submit("not an operation").result(10)  # type: ignore[arg-type]


def test_an_unknown_spool_reference_is_an_error(make) -> None:
    state: Any = make().state
    with pytest.raises((ValueError, OSError)):
        state.read_payload(SpoolRef(999, 0, 10))
