"""The durable spool (server/spool.py, behind server/store.py): payloads of every size and
alignment, spooled and committed in one group, read back byte for byte by a state opened again
after the writer stopped as a killed process would; direct writes where the file system takes
them, the page cache where it refuses them, and a failing disk reported to the push."""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from murmura.server.buffers import BufferPool
from murmura.server.spool import Spool
from murmura.server.state import DropPush, PublishVersion, RecordPush, Touch
from murmura.server.store import (
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    INLINE_MAX_BYTES,
    INLINE_SEGMENT,
    SqliteState,
)


def direct_io_works(where: Path) -> bool:
    """Whether the file system under ``where`` opens files for direct I/O."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(where / "probe")
    return True


def payloads() -> list[bytes | memoryview]:
    """Sizes around every boundary the writer has (empty, small, one block, the inline limit,
    the direct threshold, a partial last block), from plain bytes (unaligned) and from a
    page-aligned receive buffer (written in place)."""
    rng = np.random.default_rng(7)

    def data(n: int) -> bytes:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    lease = BufferPool().acquire(3 * DIRECT_MIN_BYTES + 123)
    lease.write(0, data(lease.nbytes))
    return [b"", data(10), data(DIRECT_ALIGN), data(INLINE_MAX_BYTES), data(DIRECT_MIN_BYTES),
            data(5), data(DIRECT_MIN_BYTES + 1), lease.view, data(INLINE_MAX_BYTES - 1),
            data(2 * DIRECT_MIN_BYTES + DIRECT_ALIGN), data(777)]


def spooled_bytes(items: list[bytes | memoryview]) -> int:
    """What goes to spool files (the rest is kept in the database)."""
    return sum(len(x) for x in items if len(x) >= INLINE_MAX_BYTES)


def spool_in_one_group(state: SqliteState, items: list[bytes | memoryview]) -> None:
    """Spool ``items`` and commit their pending rows in one group commit: the store thread is
    held on a first operation while they are all queued behind it."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        if not held.is_set():
            held.set()
            release.wait(10)

    state.before_commit = hold
    first = state.submit(Touch())
    assert held.wait(10)
    refs = [state.spool(x).result(10) for x in items]
    futures = [state.submit(RecordPush(i + 1, "c", f"u{i}", {"n": i}, 0, ref))
               for i, ref in enumerate(refs)]
    release.set()
    first.result(10)
    for fut in futures:
        fut.result(10)
    assert state.commits == 2 and state.committed_ops == 1 + len(items)  # one group


def test_a_group_commit_of_mixed_payloads_is_intact_after_reopening(tmp_path: Path) -> None:
    items = payloads()
    state = SqliteState(tmp_path)
    state.load()
    spool_in_one_group(state, items)
    direct, buffered = state.direct_bytes, state.buffered_bytes
    state.abandon()  # as kill -9 would leave it, once the commit was acknowledged

    again = SqliteState(tmp_path)
    pending = again.load().pending
    try:
        assert [p.seq for p in pending] == list(range(1, len(items) + 1))
        for p, expected in zip(pending, items, strict=True):
            assert p.ref.length == len(expected)
            assert again.read_payload(p.ref) == bytes(expected)
    finally:
        again.close()
    large = sum(len(x) for x in items if len(x) >= DIRECT_MIN_BYTES)
    assert direct + buffered == spooled_bytes(items)
    assert [p.ref.segment == INLINE_SEGMENT for p in pending] == \
        [len(x) < INLINE_MAX_BYTES for x in items]  # small ones committed with their rows
    if direct_io_works(tmp_path):
        assert direct == large  # every large payload went straight to the disk
        assert all(p.ref.offset % DIRECT_ALIGN == 0 for p in pending
                   if p.ref.length >= DIRECT_MIN_BYTES)


def test_a_file_system_that_refuses_direct_writes_gets_them_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Spool, data: memoryview, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(Spool, "_write_direct", refuse)
    items = payloads()
    state = SqliteState(tmp_path)
    state.load()
    spool_in_one_group(state, items)
    assert state.direct_bytes == 0 and state.buffered_bytes == spooled_bytes(items)
    state.close()

    again = SqliteState(tmp_path)
    try:
        assert [again.read_payload(p.ref) for p in again.load().pending] == \
            [bytes(x) for x in items]
    finally:
        again.close()


def test_a_failing_direct_write_fails_the_spool_and_the_next_one_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = Spool._write_direct

    def disk_full_once(self: Spool, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, data, offset)

    monkeypatch.setattr(Spool, "_write_direct", disk_full_once)
    state = SqliteState(tmp_path)
    state.load()
    if not direct_io_works(tmp_path):
        state.close()
        pytest.skip("the file system under tmp_path has no direct I/O")
    payload = os.urandom(DIRECT_MIN_BYTES + 11)
    with pytest.raises(OSError, match="No space left"):
        state.spool(payload).result(10)  # the push that waits is refused (retryable)
    ref = state.spool(payload).result(10)
    state.submit(RecordPush(1, "c", "u", {}, 0, ref)).result(10)
    state.close()

    again = SqliteState(tmp_path)
    try:
        (pending,) = again.load().pending
        assert again.read_payload(pending.ref) == payload
    finally:
        again.close()


def test_small_payloads_live_in_the_database_only_while_their_updates_are_pending(
        tmp_path: Path) -> None:
    state = SqliteState(tmp_path)
    state.load()
    for seq, payload in ((1, b"one"), (2, b"two")):
        ref = state.spool(payload).result(10)
        state.submit(RecordPush(seq, "c", f"u{seq}", {}, 0, ref)).result(10)
    state.close()

    state = SqliteState(tmp_path)  # a later life: new ids never reuse a pending one's
    assert [state.read_payload(p.ref) for p in state.load().pending] == [b"one", b"two"]
    ref = state.spool(b"three").result(10)
    state.submit(RecordPush(3, "c", "u3", {}, 0, ref)).result(10)
    state.submit(PublishVersion(1, {"version": 1}, "ckpt-1", (1,))).result(10)
    state.submit(DropPush(2, "c", "u2")).result(10)
    state.close()

    with sqlite3.connect(tmp_path / "state.db") as db:
        kept = [bytes(d) for (d,) in db.execute("SELECT data FROM inline")]
    assert kept == [b"three"]  # the published and the dropped ones' payloads are gone
    again = SqliteState(tmp_path)
    try:
        (pending,) = again.load().pending
        assert pending.seq == 3 and again.read_payload(pending.ref) == b"three"
    finally:
        again.close()
