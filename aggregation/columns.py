"""Where a rule's per-coordinate work runs: a pluggable runner over column blocks.

Rules that need every update (the Huber stage of ``default``, the coordinate median, the
trimmed mean) spend almost all their time in work that is independent per coordinate: sort
a column of n values, clip, average. That work is cut into fixed blocks of
:data:`BLOCK` columns and handed to a :class:`ColumnRunner`. The default runner uses threads
of the calling process (:data:`THREADS`); the server plugs in one that sends ranges of blocks
to its aggregation worker processes (``server/columns.py``), so a version's rule work is
spread over the tier instead of being serial on the publisher.

Why blocks of a fixed size, whoever runs them: a kernel computes each block the same way
whatever range it is part of, so threads, one worker or twelve give bit-identical results.
A runner may run a kernel elsewhere only if the arrays it reads live where that process can
see them; :meth:`ColumnRunner.allocate` hands out such arrays (plain ``np.empty`` for the
thread runner), and a runner falls back to threads for arrays it did not allocate.

This module is pure: no I/O, no processes; the process runner lives in the server.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["BLOCK", "ColumnRunner", "Kernel", "THREADS", "ThreadColumns", "UNIT", "blocks",
           "copy_rows", "reduction_unit", "run_blocks", "scale_into"]

#: Columns per block: 8192 x 1000 updates x 4 B = 32 MB of temporaries per block.
BLOCK = 8192
#: Columns per unit of a reduction (a sketch, squared norms): each unit's partial is taken
#: alone and the partials are added in unit order, so any split of the work gives the same
#: bits, and a job that fills a range of units writes nothing another job writes.
UNIT = 64 * BLOCK

#: ``kernel(arrays, params, out, a, b)`` does the work of columns ``a..b``: fills
#: ``out[a:b]`` (or, for a reduction, ``out[a // unit]``) from ``arrays`` and the small
#: picklable ``params``; with ``out=None`` it writes into one of ``arrays`` instead. It must be
#: a module-level function (it may be sent to another process by reference) and touch only
#: its own columns (or unit).
#: (Typed loosely: each kernel narrows ``params`` and ``out`` to what it takes.)
Kernel = Callable[..., None]


def blocks(p: int, block: int = BLOCK, *, start: int = 0) -> list[tuple[int, int]]:
    """The column blocks ``[a, b)`` of ``start..p``; ``start`` must be a multiple of ``block``
    so that any range of blocks cuts the columns exactly as the whole does."""
    if start % block:
        raise ValueError(f"a column range must start on a block boundary, got {start}")
    return [(a, min(a + block, p)) for a in range(start, p, block)]


def reduction_unit(multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least :data:`UNIT`: the unit of a
    reduction whose kernel steps through its columns ``multiple`` at a time."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return multiple * -(-UNIT // multiple)


def run_blocks(kernel: Kernel, arrays: Mapping[str, np.ndarray | None], params: Any,
               out: npt.NDArray[Any] | None, a: int, b: int, unit: int = BLOCK) -> None:
    """Run ``kernel`` over the ``unit``-column blocks of columns ``a..b`` in order (``a`` on
    a boundary)."""
    for lo, hi in blocks(b, unit, start=a):
        kernel(arrays, params, out, lo, hi)


def copy_rows(arrays: Mapping[str, np.ndarray | None], params: tuple[Any, Any],
              out: None, a: int, b: int) -> None:
    """Kernel: ``dst[params[1], a:b] = src[params[0], a:b]`` (rows of one array into rows
    of another, column block by column block)."""
    src, dst = arrays["src"], arrays["dst"]
    assert src is not None and dst is not None
    dst[params[1], a:b] = src[params[0], a:b]


def scale_into(arrays: Mapping[str, np.ndarray | None], params: tuple[int, float],
               out: None, a: int, b: int) -> None:
    """Kernel: ``dst[row, a:b] = src[a:b] * factor`` in float32 (``params = (row, factor)``),
    a buffered rule taking an update in."""
    src, dst = arrays["src"], arrays["dst"]
    assert src is not None and dst is not None
    row, factor = params
    np.multiply(src[a:b], np.float32(factor), out=dst[row, a:b], casting="unsafe")


class ColumnRunner(Protocol):
    """Runs a :data:`Kernel` over every block of ``p`` columns and owns the arrays it can
    share with whatever runs the blocks."""

    def allocate(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """An uninitialised array that :meth:`run` can hand to its executors in place."""

    def release(self, array: npt.NDArray[Any]) -> None:
        """Give back an array from :meth:`allocate` (others are ignored); do not use it after."""

    def run(self, kernel: Kernel, arrays: Mapping[str, np.ndarray | None], params: Any,
            out: npt.NDArray[Any] | None, p: int, *, unit: int = BLOCK) -> None:
        """Run ``kernel`` over every ``unit``-column block of ``p`` columns (:data:`BLOCK`
        for per-column work, a reduction's unit for partials); returns when all are done."""


class ThreadColumns:
    """Blocks on up to ``max_threads`` threads of this process (numpy's sorts and torch's
    clamp release the GIL, so two threads use both cores of a small server)."""

    def __init__(self, max_threads: int | None = None) -> None:
        self.max_threads = max_threads

    def allocate(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        return np.empty(shape, dtype=dtype)

    def release(self, array: npt.NDArray[Any]) -> None:
        pass

    def run(self, kernel: Kernel, arrays: Mapping[str, np.ndarray | None], params: Any,
            out: npt.NDArray[Any] | None, p: int, *, unit: int = BLOCK) -> None:
        todo = blocks(p, unit)
        limit = self.max_threads or min(os.cpu_count() or 1, 8)
        workers = min(len(todo), limit)
        if workers <= 1:
            for a, b in todo:
                kernel(arrays, params, out, a, b)
            return
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(lambda ab: kernel(arrays, params, out, *ab), todo):
                pass


#: The runner every rule starts with.
THREADS: ColumnRunner = ThreadColumns()
