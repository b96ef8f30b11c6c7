"""The payload spool of the durable state (:class:`Spool`, owned by
:class:`~murmura.server.store.SqliteState`): numbered segment files in one directory, appended
by one writer thread, fsynced by the store thread before the rows that point into them commit.

It is kept apart from the SQLite side because it is its own job: moving bytes to the disk fast
and in the right order. The store decides what is spooled (payloads under its inline limit go
into the database instead), when the spool is fsynced (first thing in each group commit) and
which segments are still referenced (by pending rows); the spool writes, rotates, syncs, reads
back and deletes segment files.

The writer moves each payload once, from the buffer it was received into to the disk. A large
payload (:data:`DIRECT_MIN_BYTES` or more) is written with ``O_DIRECT`` at a block-aligned
offset, straight from the receive buffer or slab (page-aligned), so it is not copied into the
page cache first: that copy was most of the spool's CPU (14.5 ms per 10 MB update on the
project's VM, where a fresh page-cache page is a first touch of guest memory), and a spooled
payload is only read again after a crash. Its last partial block goes through a small aligned
scratch buffer, padded with zeros; a source that is not aligned goes through that buffer in
slices. Small payloads, file systems without ``O_DIRECT`` (or that refuse a direct write) and
other platforms use plain writes. Either way the group commit's :meth:`Spool.sync` makes the
bytes and the file's size durable before the rows that point at them.

Crash recovery: a segment is never appended to by a later life (:meth:`Spool.resume` starts
past every existing one), a rotation fsyncs the old segment and the directory entry of the new
one, and only segments older than the open one and unreferenced are deleted.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from murmura.server.futures import settle
from murmura.server.state import SpoolRef

log = logging.getLogger(__name__)

__all__ = ["BOUNCE_BYTES", "DIRECT_ALIGN", "DIRECT_MIN_BYTES", "SEGMENT_BYTES", "Spool",
           "fsync_dir"]

#: A spool segment is closed and a new one started past this size; a segment is deleted once
#: no pending update refers to it.
SEGMENT_BYTES = 64 << 20
#: Payloads at least this large are written to the spool with ``O_DIRECT`` (see the module
#: docstring); smaller ones are cheaper through the page cache, which the group commit flushes.
DIRECT_MIN_BYTES = 256 << 10
#: Alignment of a direct write's buffer, file offset and length: the largest logical block
#: size in use (512 B or 4 KiB).
DIRECT_ALIGN = 4096
#: The aligned scratch buffer for a payload's last partial block and unaligned sources.
BOUNCE_BYTES = 4 << 20


@dataclass
class _Write:
    data: memoryview | None   # dropped once written: the caller's buffer is not held after
    future: Future[SpoolRef]


class Spool:
    """Segment files in ``directory`` (see the module docstring).

    Threads: :meth:`write` may be called from any thread, one at a time and never after
    :meth:`stop` (the owner calls it under its lock, after checking it is open); only the
    writer thread appends and rotates; :meth:`sync` and :meth:`free` run on the store thread,
    and ``_lock`` guards what they read of the writer's segment.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(exist_ok=True)
        self._jobs: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._segment = 0
        self._segment_fd: int | None = None
        self._segment_size = 0
        self._written = 0            # payload bytes appended (writer thread)
        self._synced = 0             # of which fsynced (store thread)
        # Direct writes (writer thread only): a second descriptor of the open segment with
        # O_DIRECT, and the aligned scratch buffer, made on first use.
        self._direct = hasattr(os, "O_DIRECT")
        self._direct_fd: int | None = None
        self._bounce: np.ndarray | None = None
        #: Payload bytes written directly and through the page cache (tests, benchmarks).
        self.direct_bytes = 0
        self.buffered_bytes = 0

    # -- start-up -----------------------------------------------------------------------------

    def resume(self) -> None:
        """Start numbering after every segment on disk: never append to a past life's."""
        segments = [int(p.stem) for p in self.dir.glob("*.seg") if p.stem.isdigit()]
        self._segment = max(segments, default=0) + 1

    def read(self, ref: SpoolRef) -> bytes:
        """A spooled payload's bytes (start-up replay)."""
        with open(self._path(ref.segment), "rb") as f:
            f.seek(ref.offset)
            data = f.read(ref.length)
        if len(data) != ref.length:
            raise ValueError(f"spool segment {ref.segment} is shorter than its pending updates "
                             f"say ({ref.offset}+{ref.length})")
        return data

    # -- any thread ---------------------------------------------------------------------------

    def write(self, data: memoryview) -> Future[SpoolRef]:
        """Queue ``data`` (bytes, cast to ``B``) for the writer thread, started on first use.
        The future holds its reference once written, not yet fsynced (:meth:`sync` does)."""
        job = _Write(data, Future())
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="murmura-spool",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job.future

    # -- the writer thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                assert job.data is not None
                settle(job.future, result=self._append(job.data))
            except BaseException as exc:  # noqa: BLE001 - handed to the push that waits
                settle(job.future, exc=exc)
            finally:
                job.data = None

    def _append(self, data: memoryview) -> SpoolRef:
        """Append one payload to the open segment (rotating first if it is full). Written, not
        yet durable: the group commit's :meth:`sync` makes it so."""
        if self._segment_fd is None or self._segment_size >= SEGMENT_BYTES:
            self._rotate()
        assert self._segment_fd is not None
        start = self._segment_size
        offset, end = start, start + len(data)
        direct = self._direct_fd is not None and len(data) >= DIRECT_MIN_BYTES
        if direct:
            offset = -(-start // DIRECT_ALIGN) * DIRECT_ALIGN  # a hole before it reads as zeros
            try:
                end = self._write_direct(data, offset)
                self.direct_bytes += len(data)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("the spool's file system refuses direct writes (%s); writing through "
                         "the page cache from now on", exc)
                self._direct = direct = False
                self._close_direct()
                offset, end = start, start + len(data)
        if not direct:
            _pwrite_all(self._segment_fd, data, offset)
            self.buffered_bytes += len(data)
        with self._lock:
            self._segment_size = end
            self._written += end - start
        return SpoolRef(self._segment, offset, len(data))

    def _write_direct(self, data: memoryview, offset: int) -> int:
        """Write ``data`` at the aligned ``offset`` of the open segment with O_DIRECT; returns
        where the record ends (its last block padded with zeros)."""
        assert self._direct_fd is not None
        fd, n = self._direct_fd, len(data)
        body = n - n % DIRECT_ALIGN
        src = np.frombuffer(data, dtype=np.uint8)
        if self._bounce is None:
            self._bounce = np.frombuffer(mmap.mmap(-1, BOUNCE_BYTES), dtype=np.uint8)
        bounce = self._bounce
        if src.ctypes.data % DIRECT_ALIGN == 0:
            _pwrite_all(fd, data[:body], offset)  # from the receive buffer or slab itself
        else:  # an unaligned source (an in-process caller's bytes): through the scratch
            for at in range(0, body, BOUNCE_BYTES):
                k = min(BOUNCE_BYTES, body - at)
                np.copyto(bounce[:k], src[at:at + k])
                _pwrite_all(fd, bounce.data[:k], offset + at)
        tail = n - body
        if not tail:
            return offset + body
        bounce[:tail] = src[body:]
        bounce[tail:DIRECT_ALIGN] = 0
        _pwrite_all(fd, bounce.data[:DIRECT_ALIGN], offset + body)
        return offset + body + DIRECT_ALIGN

    def _close_direct(self) -> None:
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None

    def _rotate(self) -> None:
        old = self._segment_fd
        if old is not None:
            os.fsync(old)  # what the old segment holds is durable before it is left
        path = self._path(self._segment + (old is not None))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        fsync_dir(self.dir)  # the new file's name is durable before rows refer to it
        self._close_direct()
        if self._direct:
            try:  # the same file for direct writes (fsync of either descriptor covers both)
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)  # type: ignore[attr-defined]
            except OSError as exc:  # e.g. a file system without direct I/O
                log.info("the spool's file system has no direct writes (%s); writing through "
                         "the page cache", exc)
                self._direct = False
        with self._lock:
            if old is not None:
                self._segment += 1
            self._segment_fd, self._segment_size = fd, os.fstat(fd).st_size
            self._synced = self._written if old is not None else self._synced
        if old is not None:
            os.close(old)

    def _path(self, segment: int) -> Path:
        return self.dir / f"{segment:08d}.seg"

    # -- the store thread ---------------------------------------------------------------------

    def sync(self) -> None:
        """Fsync what was appended so far (a dup of the segment's fd, so the writer may rotate
        meanwhile). The store calls it before the commit of the rows that point at it."""
        with self._lock:
            if self._segment_fd is None or self._written == self._synced:
                return
            mark, fd = self._written, os.dup(self._segment_fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self._synced = max(self._synced, mark)

    def free(self, keep: set[int]) -> None:
        """Delete segments not in ``keep`` (those pending updates refer to); never the open
        one, nor one the writer may be opening."""
        with self._lock:
            current = self._segment
        for p in self.dir.glob("*.seg"):
            if p.stem.isdigit():
                n = int(p.stem)
                if n not in keep and n < current:
                    p.unlink(missing_ok=True)

    # -- shutting down ------------------------------------------------------------------------

    def stop(self, timeout: float | None) -> None:
        """Write what is queued, then stop the writer thread (the files stay open: the store
        thread may still sync them; :meth:`close` closes them)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)

    def drop_queued(self, reason: str) -> None:
        """Fail every queued write with a :class:`RuntimeError` saying ``reason`` (tests: a
        killed process writes nothing more)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                settle(job.future, exc=RuntimeError(reason))

    def close(self) -> None:
        """Close the segment's descriptors (after :meth:`stop` and the store thread's end)."""
        if self._segment_fd is not None:
            os.close(self._segment_fd)
            self._segment_fd = None
        self._close_direct()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
