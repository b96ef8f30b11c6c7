"""Shared-memory slabs: a pushed payload's bytes land once, and every process reads them in place.

The gateway receives a payload straight into a slab; an aggregation function in a worker process
gets a :class:`SlabRef` (name, offset, length: a few dozen bytes through a pipe) and maps the
same pages with :func:`attach`; it writes the decoded vector into an output slab it was given as
an :class:`OutRef`. No payload byte crosses a pipe or is pickled.

Slabs come in size classes (powers of two from 1 MiB) so a released slab serves the next payload
of a similar size without a new segment, and the pages it already touched stay mapped. A slab is
only as large in memory as the pages written into it (``/dev/shm`` is tmpfs), so rounding up to
a class costs address space, not memory. :class:`SlabPool` caps the bytes handed out; a request
beyond the cap gets ``None``, which the gateway turns into back-pressure.

Attaching in another process must not register the segment with ``multiprocessing``'s resource
tracker: on Python < 3.13 ``SharedMemory(name)`` does, and a tracker that is not the owner's
unlinks the segment when that process exits (https://github.com/python/cpython/issues/82300).
Unregistering afterwards is no fix: forkserver and spawn children share their parent's tracker,
where an unregister would drop the *owner's* registration. So :func:`attach` opens the segment
without registering it at all (``track=False`` on 3.13+, ``shm_open`` + ``mmap`` before).

Functions that run under every backend take inputs as ``SlabRef | bytes-like`` and read them
with :func:`resolve`, and finish with :func:`write_out` (see there): a local backend passes the
refs as they are, a remote one (Ray) ships the bytes and collects the output array instead.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count
from multiprocessing import shared_memory
from typing import Any, NamedTuple

import numpy as np

logger = logging.getLogger(__name__)

#: The smallest size class; smaller requests (an empty payload included) get a slab this big.
MIN_SLAB_BYTES = 1 << 20
#: Idle slabs kept per size class by default; releasing more unlinks them.
DEFAULT_IDLE_PER_CLASS = 2
#: Attachments a process keeps open (least recently used beyond this are closed).
MAX_ATTACHED = 64


@dataclass(frozen=True)
class SlabRef:
    """Where some bytes live: a slab's name and a byte range in it. Tiny and picklable, so it is
    what crosses process boundaries instead of the bytes."""

    name: str
    offset: int = 0
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a SlabRef needs the slab's name")
        if self.offset < 0 or self.nbytes < 0:
            raise ValueError(
                f"SlabRef offset and nbytes must be >= 0, got {self.offset} and {self.nbytes}")


@dataclass(frozen=True)
class OutRef(SlabRef):
    """A :class:`SlabRef` that a function writes its output array into (see :func:`write_out`).

    The marker type lets a remote backend tell outputs from inputs: it ships ``None`` in its
    place and copies the array the function returns into this range itself.
    """


class OutArray(NamedTuple):
    """What a function returns when it was given ``out=None`` (a remote backend): the output
    array, and the small result it would have returned after writing the array into ``out``."""

    array: np.ndarray
    result: Any = None


# -- the owner's side ------------------------------------------------------------------------


class Slab:
    """One shared-memory segment lent out by a :class:`SlabPool`.

    ``size`` is the segment's (size-class) capacity, ``nbytes`` what was asked for. ``buf`` is a
    writable view of all ``size`` bytes; do not use it after :meth:`SlabPool.release`.
    """

    __slots__ = ("_shm", "_released", "name", "nbytes", "size", "__weakref__")

    def __init__(self, shm: shared_memory.SharedMemory, size: int, nbytes: int) -> None:
        self._shm = shm
        self._released = False
        self.name: str = shm.name
        self.size = size
        self.nbytes = nbytes

    @property
    def buf(self) -> memoryview:
        if self._released:
            raise ValueError(f"slab {self.name} was released")
        buf = self._shm.buf
        assert buf is not None
        return buf[: self.size]

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` in at ``offset`` (a received chunk lands in its place; NumPy copies
        without holding the GIL, so the gateway's other threads run meanwhile)."""
        end = offset + len(data)
        if self._released:
            raise ValueError(f"slab {self.name} was released")
        if offset < 0 or end > self.size:
            raise ValueError(f"bytes {offset}..{end} do not fit slab {self.name} of "
                             f"{self.size} bytes")
        buf = self._shm.buf
        assert buf is not None
        np.copyto(np.frombuffer(buf, dtype=np.uint8, count=end - offset, offset=offset),
                  np.frombuffer(data, dtype=np.uint8))

    def _range(self, offset: int, nbytes: int | None) -> tuple[int, int]:
        if nbytes is None:
            nbytes = max(self.nbytes - offset, 0)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes {offset}..{offset + (nbytes or 0)} do not fit slab "
                             f"{self.name} of {self.size} bytes")
        return offset, nbytes

    def ref(self, offset: int = 0, nbytes: int | None = None) -> SlabRef:
        """A reference to ``nbytes`` (default: the requested size less ``offset``) at
        ``offset``, to hand to a function in another process."""
        return SlabRef(self.name, *self._range(offset, nbytes))

    def out_ref(self, offset: int = 0, nbytes: int | None = None) -> OutRef:
        """Like :meth:`ref`, marked as a function's output (see :class:`OutRef`)."""
        return OutRef(self.name, *self._range(offset, nbytes))

    def __repr__(self) -> str:
        state = "released" if self._released else "in use"
        return f"Slab({self.name!r}, size={self.size}, nbytes={self.nbytes}, {state})"


#: Slabs owned by a live pool of this process, by name: :func:`attach` in the owner process
#: returns a view of the owner's mapping instead of mapping the segment a second time.
_OWNED: dict[str, shared_memory.SharedMemory] = {}


def _size_class(nbytes: int) -> int:
    if nbytes <= MIN_SLAB_BYTES:
        return MIN_SLAB_BYTES
    return 1 << (nbytes - 1).bit_length()


def _round_up(nbytes: int, unit: int) -> int:
    return max(unit, -(-nbytes // unit) * unit)


def _close_segment(shm: shared_memory.SharedMemory, *, unlink: bool) -> None:
    _OWNED.pop(shm.name, None)
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    try:
        shm.close()
    except BufferError:
        # A view of it is still alive somewhere (a caller kept slab.buf): the name is gone
        # already, and the pages go when the last view does (the views keep the mapping
        # alive). Stop SharedMemory.__del__ from trying again and printing the same error.
        logger.debug("slab %s closed while a view of it is alive", shm.name)
        shm.close = lambda: None  # type: ignore[method-assign]


def _close_all(segments: dict[str, shared_memory.SharedMemory]) -> None:
    for shm in list(segments.values()):
        _close_segment(shm, unlink=True)
    segments.clear()


class SlabPool:
    """Shared-memory slabs in size classes, recycled, with a cap on the bytes lent out.

    Thread-safe (the gateway acquires on its event loop, the publisher may release from its own
    thread). Every segment this pool created is unlinked by :meth:`close`, when the pool is
    garbage-collected, or at interpreter exit; if the process dies, ``multiprocessing``'s
    resource tracker unlinks them.
    """

    def __init__(self, max_bytes: int, *, prefix: str = "murmura",
                 idle_per_class: int = DEFAULT_IDLE_PER_CLASS) -> None:
        if max_bytes < MIN_SLAB_BYTES:
            raise ValueError(f"max_bytes must be at least one slab ({MIN_SLAB_BYTES} bytes), "
                             f"got {max_bytes}")
        if idle_per_class < 0:
            raise ValueError(f"idle_per_class must be >= 0, got {idle_per_class}")
        if not prefix or not prefix.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"prefix must be letters, digits, '-' or '_', got {prefix!r}")
        self.max_bytes = max_bytes
        self.idle_per_class = idle_per_class
        self.prefix = prefix
        # Short names (macOS allows 31 characters): prefix, pid, a random tag against a stale
        # segment of an earlier process with the same pid, a counter. Names are never reused,
        # so a worker's cached attachment can never point at a different slab.
        self._stem = f"{prefix}_{os.getpid():x}_{secrets.token_hex(3)}_"
        self._counter = count()
        self._lock = threading.Lock()
        self._segments: dict[str, shared_memory.SharedMemory] = {}  # every live segment
        self._idle: dict[int, list[shared_memory.SharedMemory]] = {}  # size -> oldest first
        self._idle_since: dict[str, float] = {}  # idle segment -> when it was released
        self._in_use: dict[str, Slab] = {}
        self._in_use_bytes = 0
        self._idle_bytes = 0
        self._closed = False
        self.created = 0
        self.reused = 0
        self.refused = 0
        self.unlinked = 0
        self._finalizer = weakref.finalize(self, _close_all, self._segments)

    # -- lending --------------------------------------------------------------------------

    def acquire(self, nbytes: int) -> Slab | None:
        """A slab of at least ``nbytes`` (0 is fine), or None if lending it would put more than
        ``max_bytes`` in use: back-pressure, try again once something is released.

        Raises ``ValueError`` for a request larger than ``max_bytes``, which could never be
        served.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > self.max_bytes:
            raise ValueError(f"a {nbytes}-byte slab can never fit this pool's max_bytes="
                             f"{self.max_bytes}; raise the cap or lower the payload size limit")
        size = _size_class(nbytes)
        if size > self.max_bytes:  # the class would not fit the cap; an exact-size slab does
            size = min(_round_up(nbytes, MIN_SLAB_BYTES), self.max_bytes)
        with self._lock:
            if self._closed:
                raise RuntimeError("the slab pool is closed")
            if self._in_use_bytes + size > self.max_bytes:
                self.refused += 1
                return None
            idle = self._idle.get(size)
            if idle:
                shm = idle.pop()  # most recently used: its pages are the likeliest mapped
                self._idle_since.pop(shm.name, None)
                self._idle_bytes -= size
                self.reused += 1
            else:
                self._trim_idle(self.max_bytes - self._in_use_bytes - size)
                shm = self._create(size)
            slab = Slab(shm, size, nbytes)
            self._in_use[slab.name] = slab
            self._in_use_bytes += size
            return slab

    def release(self, slab: Slab) -> bool:
        """Take ``slab`` back; True if it is kept for reuse, False if it was unlinked.

        Releasing a slab twice is a no-op (False); a slab of another pool is a ``ValueError``.
        """
        with self._lock:
            if slab._released:
                return False
            if self._in_use.get(slab.name) is not slab:
                raise ValueError(f"{slab!r} was not lent by this pool")
            del self._in_use[slab.name]
            slab._released = True
            self._in_use_bytes -= slab.size
            shm = slab._shm
            idle = self._idle.setdefault(slab.size, [])
            if self._closed or len(idle) >= self.idle_per_class:
                self._unlink(shm)
                return False
            idle.append(shm)
            self._idle_since[shm.name] = time.monotonic()
            self._idle_bytes += slab.size
            return True

    def trim_idle(self, idle_s: float, *, now: float | None = None) -> int:
        """Unlink the idle slabs nobody has taken for ``idle_s`` seconds; how many went. A
        burst of concurrent pushes grows the pool; once the burst is over its slabs (shared
        memory and their descriptors) go back, as idle decoding workers do."""
        now = time.monotonic() if now is None else now
        gone = 0
        with self._lock:
            for size, idle in self._idle.items():
                keep = []
                for shm in idle:
                    if now - self._idle_since.get(shm.name, now) >= idle_s:
                        self._idle_bytes -= size
                        self._unlink(shm)
                        gone += 1
                    else:
                        keep.append(shm)
                idle[:] = keep
        return gone

    def close(self) -> None:
        """Unlink every segment, lent or idle. Views still alive keep their pages (not their
        names) until they are dropped; nothing can attach to a slab of a closed pool."""
        with self._lock:
            self._closed = True
            for slab in self._in_use.values():
                slab._released = True
            self.unlinked += len(self._segments)
            self._in_use.clear()
            self._idle.clear()
            self._in_use_bytes = self._idle_bytes = 0
            self._finalizer()

    def __enter__(self) -> SlabPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- accounting -------------------------------------------------------------------------

    @property
    def in_use_bytes(self) -> int:
        """Capacity of the slabs lent out (what ``max_bytes`` caps)."""
        return self._in_use_bytes

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "max_bytes": self.max_bytes,
                "in_use_bytes": self._in_use_bytes,
                "idle_bytes": self._idle_bytes,
                "slabs_in_use": len(self._in_use),
                "slabs_idle": sum(len(v) for v in self._idle.values()),
                "created": self.created,
                "reused": self.reused,
                "refused": self.refused,
                "unlinked": self.unlinked,
            }

    # -- internals (lock held) ------------------------------------------------------------

    def _create(self, size: int) -> shared_memory.SharedMemory:
        name = f"{self._stem}{next(self._counter)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self._segments[shm.name] = shm
        _OWNED[shm.name] = shm
        self.created += 1
        logger.debug("slab %s created (%d bytes)", shm.name, size)
        return shm

    def _unlink(self, shm: shared_memory.SharedMemory) -> None:
        self._segments.pop(shm.name, None)
        self._idle_since.pop(shm.name, None)
        _close_segment(shm, unlink=True)
        self.unlinked += 1
        logger.debug("slab %s unlinked", shm.name)

    def _trim_idle(self, room: int) -> None:
        """Unlink idle slabs (largest first) until they fit in ``room`` bytes, so idle and lent
        slabs together never exceed ``max_bytes``."""
        while self._idle_bytes > room:
            size = max(s for s, v in self._idle.items() if v)
            self._unlink(self._idle[size].pop(0))
            self._idle_bytes -= size


# -- the user's side (any process) -----------------------------------------------------------


class _Attachment:
    """A mapping of a segment this process does not own, never registered with a tracker."""

    __slots__ = ("_close", "buf")

    def __init__(self, name: str) -> None:
        buf: memoryview | None
        if sys.version_info >= (3, 13):
            shm = shared_memory.SharedMemory(name=name, track=False)
            buf, self._close = shm.buf, shm.close
        elif os.name == "posix":
            import _posixshmem  # what SharedMemory itself uses; only the registration is skipped

            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                mapping = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            buf, self._close = memoryview(mapping), mapping.close
        else:  # Windows: no resource tracker, and the segment lives while any handle does
            shm = shared_memory.SharedMemory(name=name)
            buf, self._close = shm.buf, shm.close
        assert buf is not None
        self.buf: memoryview = buf

    def close(self) -> None:
        try:
            self.buf.release()
            self._close()
        except BufferError:
            pass  # a view is still alive: the mapping goes when it does


_attached: OrderedDict[str, _Attachment] = OrderedDict()
_attach_lock = threading.Lock()


def attach(ref: SlabRef) -> memoryview:
    """A writable view of the bytes ``ref`` points at, in any process.

    In the pool's own process this is a view of the pool's mapping; elsewhere the segment is
    mapped once per name and cached (the last :data:`MAX_ATTACHED`), never registered with the
    resource tracker. Raises ``FileNotFoundError`` if the slab was unlinked.
    """
    owned = _OWNED.get(ref.name)
    if owned is not None:
        base = owned.buf
    else:
        with _attach_lock:
            attachment = _attached.get(ref.name)
            if attachment is None:
                attachment = _Attachment(ref.name)
                _attached[ref.name] = attachment
                while len(_attached) > MAX_ATTACHED:
                    _attached.popitem(last=False)[1].close()
            else:
                _attached.move_to_end(ref.name)
            base = attachment.buf
    assert base is not None
    end = ref.offset + ref.nbytes
    if end > len(base):
        raise ValueError(f"{ref} reaches byte {end} of slab {ref.name}, which has {len(base)}")
    return base[ref.offset:end]


def detach_all() -> None:
    """Close every attachment of this process (a worker calls this before it exits)."""
    with _attach_lock:
        while _attached:
            _attached.popitem()[1].close()


def resolve(data: SlabRef | bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    """The bytes of a function's input: a :class:`SlabRef` is attached (local backends), bytes
    a remote backend shipped in its place are viewed as they are."""
    if isinstance(data, SlabRef):
        return attach(data)
    if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
        view = memoryview(data)  # type: ignore[arg-type]  # ndarray is a buffer
        return view if view.ndim == 1 and view.format == "B" else view.cast("B")
    raise TypeError(f"expected a SlabRef or a bytes-like object, got {type(data).__name__}")


def write_out(out: OutRef | None, array: np.ndarray, result: Any = None) -> Any:
    """The last line of a function with an output array.

    With an :class:`OutRef` (local backends) the array's bytes are written into that range,
    which must be exactly as long, and ``result`` (something small) is returned. With ``None``
    (a remote backend ran the function) an :class:`OutArray` is returned instead, and the
    backend writes the array into the caller's slab; either way the caller gets ``result``.
    """
    if out is None:
        return OutArray(array, result)
    if not isinstance(out, OutRef):
        raise TypeError(f"out must be an OutRef or None, got {type(out).__name__}")
    copy_into(out, array)
    return result


def copy_into(out: SlabRef, array: np.ndarray) -> None:
    """Copy ``array``'s bytes into the range ``out`` points at (lengths must match)."""
    src = np.ascontiguousarray(array)
    if src.nbytes != out.nbytes:
        raise ValueError(f"an output of {src.nbytes} bytes does not match its {out.nbytes}-byte "
                         f"slab range in {out.name}")
    dst = np.frombuffer(attach(out), dtype=np.uint8)
    np.copyto(dst, src.reshape(-1).view(np.uint8))


__all__ = [
    "DEFAULT_IDLE_PER_CLASS",
    "MAX_ATTACHED",
    "MIN_SLAB_BYTES",
    "OutArray",
    "OutRef",
    "Slab",
    "SlabPool",
    "SlabRef",
    "attach",
    "copy_into",
    "detach_all",
    "resolve",
    "write_out",
]
