"""A robust rule's per-coordinate work in the aggregation workers.

Why: rules that need every update (``default``'s Huber stage above all) spent a version's
work on the publisher: sorting, clipping and averaging a column of n values for each of the
model's coordinates, on one process, however many workers the tier had. In the serverless
benchmark that made `default` the load with the largest serial share (66 % of an update's
CPU on 16 cores). The work is independent per coordinate, so :class:`ProcessColumns` (a
:class:`~murmura.aggregation.columns.ColumnRunner`) cuts it into ranges of column blocks and
runs them as jobs on the tier's worker processes:

* the rule's buffers (its rows, ``default``'s history rows) live in shared-memory segments
  that :meth:`ProcessColumns.allocate` hands out, so a job receives names and offsets, never
  the rows; each range's output lands in a shared output segment;
* every range covers whole blocks of :data:`~murmura.aggregation.columns.BLOCK` columns and
  a kernel computes each block alone, so any number of workers gives the bits the threads
  give (a test compares them);
* a range whose job fails (its worker died on every attempt, the backend closed) is computed
  on the publisher: nothing lost, nothing counted twice, since a job only writes its own
  range of the output.

The publisher blocks on the jobs; they run on the backend's event loop, so a call from that
loop's own thread (or before the server bound it) runs on threads instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from murmura.aggregation.columns import BLOCK, ThreadColumns, run_blocks
from murmura.server import slabs
from murmura.server.slabs import Slab, SlabPool, SlabRef, attach
from murmura.server.workers import FunctionBackend

log = logging.getLogger(__name__)

#: Below this many columns a version's work is cheaper on threads than as jobs.
MIN_COLUMNS = 1 << 17
#: The fewest columns in one job (a job costs ~1 ms to send, attach and answer).
MIN_RANGE_COLUMNS = 64 * BLOCK
#: Output arrays kept for reuse, one per shape (a rule's result, its sketches' and norms'
#: partials).
KEPT_OUTPUTS = 8
#: The longest the publisher waits for a version's column jobs before computing the rest
#: itself (the backend replaces hung workers long before).
RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ArrayRef:
    """A C-contiguous array in a shared segment: what crosses to a worker instead of it."""

    where: SlabRef
    shape: tuple[int, ...]
    dtype: str

    def array(self) -> np.ndarray:
        return np.frombuffer(attach(self.where), dtype=self.dtype,
                             count=math.prod(self.shape)).reshape(self.shape)


def column_job(kernel: Any, refs: Mapping[str, ArrayRef | None], params: Any,
               out: ArrayRef | None, a: int, b: int, unit: int = BLOCK) -> None:
    """In a worker: run ``kernel`` over the ``unit``-column blocks of columns ``a..b``."""
    torch.set_num_threads(1)  # one core per worker; the pool, not torch, uses the others
    arrays = {k: None if r is None else r.array() for k, r in refs.items()}
    run_blocks(kernel, arrays, params, None if out is None else out.array(), a, b, unit)


class ProcessColumns:
    """A column runner over a :class:`FunctionBackend`'s workers (see the module docstring).

    ``workers`` sizes the ranges (about two per worker, for balance, none under ``min_range``
    columns); work on fewer than ``min_columns`` columns stays on threads; ``max_bytes`` caps
    the shared memory its arrays take. Bind it to the backend's loop with :meth:`bind` before
    the first :meth:`run`."""

    def __init__(self, backend: FunctionBackend, *, workers: int, max_bytes: int = 1 << 40,
                 min_columns: int = MIN_COLUMNS, min_range: int = MIN_RANGE_COLUMNS,
                 shm_dir: str = "/dev/shm") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.backend = backend
        self.workers = workers
        self.min_columns = min_columns
        self.min_range = min_range
        self.shm_dir = shm_dir
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pool = SlabPool(max_bytes, prefix="murmura_rows", idle_per_class=0)
        self._slabs: dict[int, Slab] = {}  # data address of an allocated array -> its slab
        self._lock = threading.Lock()
        self._threads = ThreadColumns()
        self._addresses: dict[str, tuple[int, int]] = {}  # owned slab -> (address, size)
        self._scratch: dict[tuple[tuple[int, ...], str], np.ndarray] = {}
        self.jobs = 0
        self.fallbacks = 0  # ranges computed on the publisher because their job failed
        self.local_runs = 0  # whole runs on threads (small, unshared arrays, unbound)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    # -- arrays ----------------------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        if math.prod(shape) < self.min_columns:  # small: not worth a segment
            return np.empty(shape, dtype=dt)
        return self._shared(shape, dt)

    def _shared(self, shape: tuple[int, ...], dt: np.dtype[Any]) -> npt.NDArray[Any]:
        """An array in a shared segment (a plain one when there is no room for it)."""
        nbytes = math.prod(shape) * dt.itemsize
        if not self._room(nbytes):
            return np.empty(shape, dtype=dt)
        slab = self._pool.acquire(nbytes)
        if slab is None:
            return np.empty(shape, dtype=dt)
        array: npt.NDArray[Any] = np.frombuffer(slab.buf, dtype=dt,
                                                count=math.prod(shape)).reshape(shape)
        with self._lock:
            self._slabs[array.ctypes.data] = slab
        return array

    def release(self, array: npt.NDArray[Any]) -> None:
        with self._lock:
            slab = self._slabs.pop(array.ctypes.data, None) if array.size else None
        if slab is not None:
            self._pool.release(slab)  # unlinked; views still alive keep their pages

    def _room(self, nbytes: int) -> bool:
        """Whether the shared-memory file system can hold ``nbytes`` more (a segment larger
        than what is left would kill the process with SIGBUS when its pages are written)."""
        try:
            st = os.statvfs(self.shm_dir)
        except OSError:
            return False
        if st.f_bavail * st.f_frsize >= 2 * nbytes:
            return True
        log.warning("%s has %.0f MB free, too little for a %.0f MB buffer: the rule's column "
                    "work stays on the publisher", self.shm_dir,
                    st.f_bavail * st.f_frsize / 1e6, nbytes / 1e6)
        return False

    def _ref(self, array: np.ndarray) -> ArrayRef | None:
        """Where ``array`` lies in a shared segment, or None: one of this runner's, or any
        other slab this process owns (the tier's decoded updates)."""
        if not array.flags.c_contiguous:
            return None
        address = array.ctypes.data
        with self._lock:
            for start, slab in self._slabs.items():
                offset = address - start
                if 0 <= offset and offset + array.nbytes <= slab.nbytes:
                    return ArrayRef(slab.ref(offset, array.nbytes), array.shape, array.dtype.str)
        for name, (start, size) in self._owned_segments().items():
            offset = address - start
            if 0 <= offset and offset + array.nbytes <= size:
                return ArrayRef(SlabRef(name, offset, array.nbytes), array.shape,
                                array.dtype.str)
        return None

    def _owned_segments(self) -> dict[str, tuple[int, int]]:
        """Address and size of every slab this process owns (names are never reused, so a
        cached address stays right while its name is owned)."""
        owned = dict(slabs._OWNED)  # a snapshot: the event loop lends and takes back
        known = self._addresses
        for name in [n for n in known if n not in owned]:
            del known[name]
        for name, shm in owned.items():
            buf = shm.buf
            if name not in known and buf is not None:
                try:
                    view = np.frombuffer(buf, dtype=np.uint8)
                except (TypeError, ValueError):  # closed meanwhile
                    continue
                known[name] = (view.ctypes.data, view.size)
                del view
        return known

    # -- running ---------------------------------------------------------------------------

    def ranges(self, p: int, unit: int = BLOCK) -> list[tuple[int, int]]:
        """Column ranges of whole ``unit``-column blocks: about two per worker, none under
        :data:`MIN_RANGE_COLUMNS` columns unless a unit is longer (the last may be shorter)."""
        units = -(-p // unit)
        per = max(-(-units // (2 * self.workers)), -(-self.min_range // unit))
        return [(a, min(a + per * unit, p)) for a in range(0, p, per * unit)]

    def run(self, kernel: Any, arrays: Mapping[str, np.ndarray | None], params: Any,
            out: npt.NDArray[Any] | None, p: int, *, unit: int = BLOCK) -> None:
        plan = self._plan(arrays, out, p)
        if plan is None:
            self.local_runs += 1
            self._threads.run(kernel, arrays, params, out, p, unit=unit)
            return
        loop, refs, scratch, target = plan
        todo = self.ranges(p, unit)
        futures = [asyncio.run_coroutine_threadsafe(
            self.backend.run_now(column_job, kernel, refs, params, target, a, b, unit), loop)
            for a, b in todo]
        self.jobs += len(todo)
        failed: list[tuple[int, int, BaseException]] = []
        for (a, b), fut in zip(todo, futures, strict=True):  # every job ends before any redo
            try:
                fut.result(RUN_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the range is computed here instead
                if isinstance(exc, concurrent.futures.TimeoutError):
                    fut.cancel()
                    self._forget(out)  # a hung job may still write this output: not reused
                failed.append((a, b, exc))
        for a, b, error in failed:
            self.fallbacks += 1
            log.warning("column job %d..%d failed (%s); computing it on the publisher",
                        a, b, error)
            run_blocks(kernel, arrays, params, scratch, a, b, unit)
        if out is not None:
            out[...] = scratch

    def _plan(self, arrays: Mapping[str, np.ndarray | None], out: np.ndarray | None, p: int
              ) -> tuple[asyncio.AbstractEventLoop, dict[str, ArrayRef | None],
                         np.ndarray | None, ArrayRef | None] | None:
        """What the jobs need (the loop, the arrays' and the output's references), or None
        when the work stays on threads: too small, no loop or called from it, or an array
        (or the output) that no segment of this runner holds."""
        loop = self.loop
        if p < self.min_columns or loop is None or loop.is_closed() \
                or _running_loop() is loop:
            return None
        refs: dict[str, ArrayRef | None] = {}
        for name, array in arrays.items():
            refs[name] = None if array is None else self._ref(array)
            if array is not None and refs[name] is None:
                return None
        if out is None:
            return loop, refs, None, None
        scratch = self._output(out)
        target = None if scratch is None else self._ref(scratch)
        return None if target is None else (loop, refs, scratch, target)

    def _output(self, out: np.ndarray) -> np.ndarray | None:
        """A shared array shaped like ``out`` for the jobs to write, kept for the next run
        (a fresh segment would cost page faults in every worker, every version): one per
        shape, the last :data:`KEPT_OUTPUTS` shapes."""
        key = (out.shape, out.dtype.str)
        kept = self._scratch.pop(key, None)
        if kept is None:
            kept = self._shared(out.shape, out.dtype)
            if self._ref(kept) is None:
                return None
            while len(self._scratch) >= KEPT_OUTPUTS:
                self.release(self._scratch.pop(next(iter(self._scratch))))
        self._scratch[key] = kept  # newest last
        return kept

    def _forget(self, out: np.ndarray | None) -> None:
        if out is not None:
            kept = self._scratch.pop((out.shape, out.dtype.str), None)
            if kept is not None:
                self.release(kept)

    def stats(self) -> dict[str, int]:
        return {"column_jobs": self.jobs, "column_fallbacks": self.fallbacks,
                "column_local_runs": self.local_runs}

    def close(self) -> None:
        self._pool.close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ["ArrayRef", "MIN_COLUMNS", "ProcessColumns", "column_job"]
