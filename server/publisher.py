"""The publisher: folds and version publishing, in order, off the gRPC event loop.

Everything that touches an aggregator's accumulator runs here, one job at a time in the
order it was submitted: folding a decoded update, merging a leaf's partial, and publishing a
version (the rule's result, the optimizer step, evaluation, the metrics row, the checkpoint).
One FIFO thread gives three properties at once:

* the gRPC event loop never does model-sized work, so Join, GetTask and Pull stay fast while
  a version is published;
* folds happen in submission order, which the policies choose (sync rounds submit in sorted
  client-id order), so a rerun is bit-identical however many decode workers there are;
* no lock guards the accumulator: only this thread touches it.

``Publisher(threaded=False)`` runs every job at once on the caller's thread: the simulator's
virtual clock and the unit tests need publishing to be synchronous.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from murmura.server.futures import settle

log = logging.getLogger(__name__)
T = TypeVar("T")


class Publisher:
    """Runs submitted jobs in order on one background thread (or inline)."""

    def __init__(self, *, threaded: bool = True, name: str = "murmura-publisher") -> None:
        self.threaded = threaded
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` after every job submitted before it; its result or error in the future."""
        fut: Future[T] = Future()
        if not self.threaded:
            _run(fn, fut)
            return fut
        with self._lock:
            if self._closed:
                raise RuntimeError("the publisher is closed")
            self._pending += 1
            self._ensure_thread()
        self._jobs.put((fn, fut))
        return fut

    def post(self, fn: Callable[[], Any], *, what: str) -> None:
        """Run ``fn`` like :meth:`submit` when nobody waits for its outcome: an error is
        logged (naming ``what``), not kept. Inline (the simulator, one fold per client
        update), this spares a Future and its lock per job that nobody would read."""
        if self.threaded:
            self.submit(fn).add_done_callback(lambda fut: _log_error(fut.exception(), what))
            return
        try:
            fn()
        except Exception as exc:  # the same outcome as a failed job nobody waits for
            _log_error(exc, what)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished yet."""
        return self._pending

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, fut = item
            _run(fn, fut)
            with self._lock:
                self._pending -= 1

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every job submitted so far has run."""
        if self.threaded and self._thread is not None:
            self.submit(lambda: None).result(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)


def _log_error(exc: BaseException | None, what: str) -> None:
    if exc is not None:
        log.error("%s failed", what, exc_info=exc)


def _run(fn: Callable[[], T], fut: Future[T]) -> None:
    # A publish runs even if a waiter cancelled its future: the version it makes must not be
    # lost because the push that completed it went away.
    try:
        settle(fut, result=fn())
    except BaseException as exc:  # handed to whoever waits on the future
        settle(fut, exc=exc)


__all__ = ["Publisher"]
