"""Reusable receive buffers for pushed payloads.

A push of a large update needs one contiguous buffer to reassemble its chunks in. A fresh
``np.empty`` of that size is a new ``mmap`` every time, so the first write to each of its pages
faults (25,000 faults, tens of milliseconds and a very noisy duration for a 100 MB update on a
busy machine). Keeping a few buffers and writing into pages that are already mapped removes that
cost.

Reuse must never overwrite bytes that are still in use: a decoded update is often a zero-copy
view of the buffer (``dense-f32``), and a policy may keep it past the push (the sync policy holds
an early update until its predecessors in the cohort arrive). So a buffer goes back to the pool
only if nothing but the lease references it any more. One still referenced is parked (at most
``max_free`` of them) and checked again at the next :meth:`BufferPool.acquire`: a synchronous
push folds its update while the pushing frame still holds the decoded view, which is gone a
moment later, and the next push of that size then reuses the buffer instead of faulting in a
fresh mapping (2.4 ms against 0.3 ms for a 4 MB update). Whatever still holds a parked buffer
keeps it out of reuse. No consumer has to know about the pool.

Buffers of :data:`ALIGNED_FROM` bytes or more are page-aligned anonymous mappings, so the
durable spool can write a payload from its receive buffer to the disk directly (``O_DIRECT``
needs an aligned source; see server/spool.py) instead of through a copy.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

#: Payloads below this size use a plain allocation: malloc reuses small blocks by itself.
MIN_POOLED_BYTES = 1 << 20
#: Idle buffers kept by default (bounded memory: at most this many payloads of idle memory).
DEFAULT_MAX_FREE = 2
#: Parked buffers looked at per acquire (the oldest first).
UNPARK_SCAN = 8
#: Buffers from this size are page-aligned mappings (:func:`aligned_empty`).
ALIGNED_FROM = 1 << 16
#: From this size a mapping asks for transparent huge pages, as NumPy's large arrays do.
_HUGE_FROM = 4 << 20


def aligned_empty(nbytes: int, *, pooled: bool = True) -> np.ndarray:
    """An uninitialised, writable ``uint8`` array of ``nbytes`` that starts on a page boundary.

    A pooled buffer is an anonymous mapping of its own (unmapped when the array and its views
    are gone), so that every view of it references the array and :meth:`BufferPool.release`
    can count them. A buffer that is never pooled is an aligned slice of a slightly larger heap
    array instead: malloc recycles those pages from one push to the next, where a fresh mapping
    would fault on every page of every payload. Small sizes are plain ``np.empty``.
    """
    if nbytes < ALIGNED_FROM:
        return np.empty(nbytes, dtype=np.uint8)
    if not pooled:
        raw = np.empty(nbytes + mmap.PAGESIZE, dtype=np.uint8)
        start = -raw.ctypes.data % mmap.PAGESIZE
        return raw[start:start + nbytes]
    mapping = mmap.mmap(-1, nbytes)
    if nbytes >= _HUGE_FROM and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)


def _refcount_of_local() -> int:
    # The reference count ``sys.getrefcount`` reports for an object held by exactly one local
    # variable, measured the same way ``BufferPool.release`` measures: interpreters differ.
    probe = np.empty(1, dtype=np.uint8)
    return sys.getrefcount(probe)


_SOLE_REFERENCE = _refcount_of_local()


class ReceiveBuffer:
    """A lease on one buffer of exactly ``nbytes``: fill it with :meth:`write`, read it through
    :attr:`view`, then hand it back with :meth:`BufferPool.release`."""

    __slots__ = ("_array", "nbytes", "pooled")

    def __init__(self, array: np.ndarray, nbytes: int, *, pooled: bool) -> None:
        self._array: np.ndarray | None = array
        self.nbytes = nbytes
        self.pooled = pooled

    @property
    def view(self) -> memoryview:
        """A writable byte view of the payload (a new view each time; it keeps the buffer out
        of the pool for as long as it, or anything made from it, is alive)."""
        if self._array is None:
            raise ValueError("the buffer was released")
        return self._array.data[: self.nbytes]

    def floats(self, count: int) -> np.ndarray:
        """The first ``count`` float32 values of the buffer, as a writable array (a decoder's
        output; like :attr:`view`, it keeps the buffer out of the pool while it lives)."""
        if self._array is None:
            raise ValueError("the buffer was released")
        if 4 * count > self.nbytes:
            raise ValueError(f"{count} float32 values do not fit a {self.nbytes}-byte buffer")
        return self._array[: 4 * count].view(np.float32)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` in at ``offset`` (numpy copies without holding the GIL)."""
        if self._array is None:
            raise ValueError("the buffer was released")
        end = offset + len(data)
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"bytes {offset}..{end} do not fit a {self.nbytes}-byte buffer")
        np.copyto(self._array[offset:end], np.frombuffer(data, dtype=np.uint8))

    def _detach(self) -> np.ndarray | None:
        array, self._array = self._array, None
        return array


class BufferPool:
    """A few reusable byte buffers, handed out per push and taken back only when unreferenced.

    Not thread-safe: use it from one thread or event loop (the servicer's).
    """

    def __init__(self, max_free: int = DEFAULT_MAX_FREE, *,
                 min_bytes: int = MIN_POOLED_BYTES) -> None:
        if max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        self.max_free = max_free
        self.min_bytes = min_bytes
        self._free: list[np.ndarray] = []  # oldest first
        self._parked: list[np.ndarray] = []  # released while still referenced; oldest first
        self.allocated = 0  # new pooled-size buffers
        self.reused = 0     # leases served from the pool
        self.withheld = 0   # releases refused because something still referenced the buffer
        self.unparked = 0   # withheld buffers reused later, once nothing referenced them

    def acquire(self, nbytes: int) -> ReceiveBuffer:
        """A buffer of at least ``nbytes``: the smallest idle one that is no more than twice
        that size, or a new one."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes < self.min_bytes:
            return ReceiveBuffer(aligned_empty(nbytes, pooled=False), nbytes, pooled=False)
        if self._parked:
            self._unpark()
        free = self._free
        if free and free[-1].nbytes == nbytes:  # the usual case: updates of one size
            self.reused += 1
            return ReceiveBuffer(free.pop(), nbytes, pooled=True)
        best = -1
        for i, array in enumerate(free):
            if nbytes <= array.nbytes <= 2 * nbytes and (
                    best < 0 or array.nbytes < self._free[best].nbytes):
                best = i
        if best >= 0:
            self.reused += 1
            return ReceiveBuffer(self._free.pop(best), nbytes, pooled=True)
        self.allocated += 1
        return ReceiveBuffer(aligned_empty(nbytes), nbytes, pooled=True)

    def release(self, lease: ReceiveBuffer) -> bool:
        """End ``lease``; True if its buffer went back to the pool.

        A buffer still referenced elsewhere (a decoded update kept by a policy, a view someone
        held on to, an exception's traceback) is not reused; releasing twice is harmless.
        """
        array = lease._detach()
        if array is None or not lease.pooled or self.max_free == 0:
            return False
        if sys.getrefcount(array) > _SOLE_REFERENCE:
            self.withheld += 1
            self._parked.append(array)  # checked again at the next acquire
            if len(self._parked) > self.max_free:
                self._parked.pop(0)
            return False
        self._keep(array)
        return True

    def _keep(self, array: np.ndarray) -> None:
        self._free.append(array)
        if len(self._free) > self.max_free:
            self._free.pop(0)

    def _unpark(self) -> None:
        """Move the oldest parked buffers that nothing references any more to the idle ones
        (the oldest few only: a younger one is rarely free before an older one, and a scan of
        every parked buffer at every acquire would cost O(parked) per push)."""
        kept = 0
        for _ in range(min(UNPARK_SCAN, len(self._parked))):
            array = self._parked.pop(kept)
            # this frame's local and the call's argument: nothing else holds it
            if sys.getrefcount(array) <= _SOLE_REFERENCE:
                self.unparked += 1
                self._keep(array)
            else:
                self._parked.insert(kept, array)
                kept += 1

    @property
    def free(self) -> int:
        """Idle buffers held."""
        return len(self._free)

    @property
    def free_bytes(self) -> int:
        return sum(a.nbytes for a in self._free)

    def clear(self) -> None:
        """Drop every idle buffer (and forget the parked ones)."""
        self._free.clear()
        self._parked.clear()


__all__ = ["ALIGNED_FROM", "BufferPool", "DEFAULT_MAX_FREE", "MIN_POOLED_BYTES",
           "ReceiveBuffer", "aligned_empty"]
