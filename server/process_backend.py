"""The process backend: aggregation functions in worker processes that exist only while there
is work, in the shape of LIFL's aggregation functions (Qi, Ramakrishnan & Lee, MLSys 2024,
https://arxiv.org/abs/2405.10968).

This module is the backend's public face and its scheduling: which job runs on which worker,
the bounded queue, starting workers as the backlog grows and stopping them once idle. What
happens when a process starts, answers or exits is :mod:`murmura.server.worker_lifecycle`;
the code that runs inside a worker is :mod:`murmura.server.worker_process`. The interface
every backend shares is :mod:`murmura.server.workers`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from typing import Any

from murmura.server.worker_lifecycle import WorkerLifecycle, _Job, _State, _Worker
from murmura.server.worker_process import DEFAULT_PRELOAD, _request_preload
from murmura.server.workers import (
    BackendClosed,
    FunctionBackend,
    QueueFull,
    WorkerCrashed,
    _describe,
)

logger = logging.getLogger(__name__)

#: A pickled job or result larger than this is refused: bulk data belongs in a slab.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20


def check_not_in_worker_import() -> None:
    """Refuse to start worker processes from a script that a worker process is importing.

    Worker processes (and the forkserver they come from) import the ``__main__`` script, as
    ``__mp_main__``, so that functions defined there can be sent to them. A script without an
    ``if __name__ == "__main__":`` guard then starts a server again inside each of them, which
    starts workers that import the script again: without this check, thousands of processes.
    """
    # In the parent, multiprocessing makes __mp_main__ another name for __main__; while a
    # child runs the script it is the script's own module, named __mp_main__.
    main = sys.modules.get("__mp_main__")
    if main is not None and main is not sys.modules.get("__main__") \
            and getattr(main, "__name__", "") == "__mp_main__":
        where = getattr(main, "__file__", None) or "the main script"
        raise RuntimeError(f"{where} starts an aggregator with worker processes when it is "
                           f"imported; put that code under `if __name__ == \"__main__\":` "
                           f"(worker processes import the main script)")


class ProcessBackend(WorkerLifecycle, FunctionBackend):
    """Functions in 0..``max_workers`` worker processes, started by work and stopped by idleness.

    * **Event-driven.** No worker exists until the first job. A job that finds no idle worker
      starts one (a timed cold start) while fewer than ``max_workers`` run, and waits in a
      queue otherwise; a worker that finishes takes the next queued job at once (warm). A
      worker idle for ``idle_s`` is told to stop and exits cleanly. With ``forkserver`` a cold
      start forks a server that has ``preload`` imported (torch included), instead of a fresh
      interpreter importing it all again (``spawn``).
    * **Bounded.** When ``max_queue`` jobs wait, :meth:`run` raises :class:`QueueFull` at once.
    * **Crash-safe.** A worker that dies mid-job (SIGKILL, OOM killer) is noticed through its
      process sentinel; the job runs again on another worker, at most ``max_attempts`` times
      in all, then :meth:`run` raises :class:`WorkerCrashed`. Exceptions raised by the function
      itself are its answer and are never retried.

    It lives on one asyncio event loop (the first that calls :meth:`run`) and never blocks it:
    the loop watches each worker's pipe and sentinel with ``add_reader``, so results and deaths
    arrive as loop callbacks and all bookkeeping is single-threaded, without locks and without
    a reader thread per worker. Starting and reaping processes can block (the first forkserver
    start waits seconds for its imports), so one helper thread does only that, which also keeps
    ``multiprocessing``'s process table from being polled by two threads at once. Only small
    messages cross the pipes (job and result are each limited to ``max_message_bytes``).
    """

    def __init__(self, max_workers: int, *, idle_s: float = 10.0, max_queue: int = 64,
                 start_method: str = "forkserver", preload: tuple[str, ...] = DEFAULT_PRELOAD,
                 max_attempts: int = 3,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}; "
                             "use InlineBackend for no worker processes")
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}"
                             " ('fork' would copy the gateway's gRPC threads and locks)")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start method {start_method!r} is not available on this platform")
        check_not_in_worker_import()
        self.max_workers = max_workers
        self.idle_s = idle_s
        self.max_queue = max_queue
        self.max_attempts = max_attempts
        self.max_message_bytes = max_message_bytes
        self.start_method = start_method
        self._ctx: Any = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            _request_preload(self._ctx, tuple(preload))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._procs: ThreadPoolExecutor | None = None
        self._workers: dict[int, _Worker] = {}
        self._idle: list[_Worker] = []  # most recently idle last (taken first)
        self._queue: deque[_Job] = deque()
        self._starting = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._job_ids = count(1)
        self._worker_ids = count(1)
        self._closed = False
        self._start_failures = 0  # consecutive workers that died or failed before ready
        self._last_start_error = ""
        # counters
        self.jobs_submitted = 0
        self.jobs_done = 0
        self.jobs_failed = 0
        self.rejected = 0
        self.cold_starts = 0
        self.cold_dispatches = 0
        self.warm_dispatches = 0
        self.crashes = 0
        self.retries = 0
        self.stops = 0
        self._cold_total_s = 0.0
        self._cold_last_s = 0.0
        self._latency_total_s = 0.0
        self._warm_latency_total_s = 0.0
        self._warm_latency_n = 0

    # -- public -------------------------------------------------------------------------------

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return await self._run(fn, args, kwargs, urgent=False)

    async def run_now(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`run` for work that was already promised: never refused with QueueFull, and
        queued ahead of ordinary jobs. The tier folds accepted updates this way (a fold
        cannot be answered "busy, retry": its update is taken), and a fold ahead of decodes
        frees the slabs the decodes are waiting for."""
        return await self._run(fn, args, kwargs, urgent=True)

    async def _run(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any], *, urgent: bool) -> Any:
        if self._closed:
            raise BackendClosed("the process backend is closed")
        loop = self._bind()
        name = _describe(fn)
        payload = self._pack(fn, name, args, kwargs)
        job = _Job(next(self._job_ids), name, payload, loop.create_future(), time.monotonic())
        worker = self._idle.pop() if self._idle else None
        if worker is not None:
            self._dispatch(worker, job, warm=True)
        else:
            can_start = self._live() < self.max_workers
            if urgent:
                self._queue.appendleft(job)
            elif not can_start and len(self._queue) - self._starting >= self.max_queue:
                self.rejected += 1
                raise QueueFull(
                    f"all {self.max_workers} workers are busy and {len(self._queue)} jobs wait "
                    f"(max_queue={self.max_queue}); retry shortly")
            else:
                self._queue.append(job)
            self._ensure_capacity()
        self.jobs_submitted += 1
        try:
            return await job.future
        finally:
            if job.future.cancelled():
                try:
                    self._queue.remove(job)
                except ValueError:
                    pass  # already running: its result will be dropped

    async def warm_up(self) -> None:
        """Start the forkserver now, so that it imports ``preload`` (seconds, for torch) while
        the server starts rather than during the first job. Starts no worker."""
        if self.start_method != "forkserver":
            return
        loop = self._bind()
        from multiprocessing import forkserver

        await loop.run_in_executor(self._procs, forkserver.ensure_running)

    def stats(self) -> dict[str, Any]:
        """Workers by state, queue depth, job counts, cold starts (count, mean and last
        seconds from "a job needs a worker" to "the worker is ready"), dispatches (cold: the
        first job of a new worker; warm: any other), dispatch latency (job submitted -> the
        worker starts it, through the system-wide monotonic clock), crashes and retries."""
        states = [w.state for w in self._workers.values()]
        done, cold = self.jobs_done, self.cold_starts
        return {
            "backend": f"process/{self.start_method}",
            "max_workers": self.max_workers,
            "workers": len(states),  # every process not yet reaped
            "starting": states.count(_State.STARTING),
            "idle": states.count(_State.IDLE),
            "busy": states.count(_State.BUSY),
            "stopping": states.count(_State.STOPPING),
            "queue_depth": len(self._queue),
            "jobs_submitted": self.jobs_submitted,
            "jobs_done": done,
            "jobs_failed": self.jobs_failed,
            "rejected": self.rejected,
            "cold_starts": self.cold_starts,
            "cold_start_mean_s": self._cold_total_s / cold if cold else None,
            "cold_start_last_s": self._cold_last_s if cold else None,
            "cold_dispatches": self.cold_dispatches,
            "warm_dispatches": self.warm_dispatches,
            "dispatch_latency_mean_s": self._latency_total_s / done if done else None,
            "warm_dispatch_latency_mean_s": (self._warm_latency_total_s / self._warm_latency_n
                                             if self._warm_latency_n else None),
            "crashes": self.crashes,
            "retries": self.retries,
            "stops": self.stops,
        }

    def worker_pids(self, *, busy_only: bool = False) -> list[int]:
        """Process ids of the live workers (the busy ones only, with ``busy_only``): for
        operators and fault tests."""
        return [w.pid for w in self._workers.values()
                if w.pid is not None and (not busy_only or w.state is _State.BUSY)]

    async def close(self, grace_s: float = 5.0) -> None:
        """Refuse new jobs, fail the queued ones, let running jobs finish for ``grace_s``
        seconds, then kill what is left. Every worker is reaped before this returns."""
        if self._closed and not self._workers:
            return
        self._closed = True
        self._fail_queue(BackendClosed("the process backend was closed before the job ran"))
        if self._loop is None:
            return
        while self._tasks:  # starts in progress finish first, so every worker has a process
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for worker in list(self._workers.values()):
            if worker.state in (_State.STARTING, _State.IDLE, _State.BUSY):
                self._stop(worker)
        waiting = [w.exited for w in self._workers.values()]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=grace_s)
            if late:
                loop = self._loop
                for worker in list(self._workers.values()):
                    if not worker.exited.done():
                        logger.warning("worker %d did not stop within %.1f s; killing it",
                                       worker.id, grace_s)
                        await loop.run_in_executor(self._procs, worker.process.kill)
                await asyncio.wait(late, timeout=30.0)
        while self._tasks:  # reaps
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._procs is not None:
            self._procs.shutdown(wait=True)
            self._procs = None

    # -- scheduling (all on the loop thread) --------------------------------------------------

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._procs = ThreadPoolExecutor(1, thread_name_prefix="murmura-fn-procs")
        elif self._loop is not loop:
            raise RuntimeError("a ProcessBackend serves the event loop that first used it")
        return loop

    def _pack(self, fn: Callable[..., Any], name: str, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> bytes:
        if not callable(fn):
            raise TypeError(f"fn must be a function, got {type(fn).__name__}")
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"cannot send {name} to a worker: {exc}. The function must be "
                            "module-level and the arguments picklable") from exc
        if len(payload) > self.max_message_bytes:
            raise ValueError(f"the job {name} is {len(payload)} bytes pickled (limit "
                             f"{self.max_message_bytes}); pass bulk data as a SlabRef")
        return payload

    def _live(self) -> int:
        return sum(w.state in (_State.STARTING, _State.IDLE, _State.BUSY)
                   for w in self._workers.values())

    def _ensure_capacity(self) -> None:
        """Start workers for the queued jobs no starting worker will take, up to the cap."""
        if self._closed:
            return
        if self._start_failures >= self.max_attempts and self._live() == 0:
            self._fail_queue(WorkerCrashed(
                f"{self._start_failures} worker processes in a row died or failed before they "
                f"were ready ({self._last_start_error}); the {self.start_method} start method "
                "cannot run workers here"))
            self._start_failures = 0
            return
        need = len(self._queue) - self._starting
        while need > 0 and self._live() < self.max_workers:
            self._spawn()
            need -= 1

    def _pump(self) -> None:
        while self._queue and self._idle:
            job = self._queue.popleft()
            if not job.future.done():
                self._dispatch(self._idle.pop(), job, warm=True)
        self._ensure_capacity()

    def _fail_queue(self, exc: Exception) -> None:
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(exc)

    def _dispatch(self, worker: _Worker, job: _Job, *, warm: bool) -> None:
        if worker.idle_timer is not None:
            worker.idle_timer.cancel()
            worker.idle_timer = None
        worker.state = _State.BUSY
        try:
            worker.conn.send((job.id, job.payload))
        except OSError:  # it died under us: its sentinel will fire; the job never started
            logger.debug("worker %d gone before job %d could be sent", worker.id, job.id)
            self._queue.appendleft(job)
            return
        worker.job = job
        job.attempts += 1
        job.warm = warm
        if warm:
            self.warm_dispatches += 1
        else:
            self.cold_dispatches += 1

    def _next_job(self, worker: _Worker, *, warm: bool) -> None:
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                self._dispatch(worker, job, warm=warm)
                return
        worker.state = _State.IDLE
        self._idle.append(worker)
        assert self._loop is not None
        worker.idle_timer = self._loop.call_later(self.idle_s, self._retire, worker)

    def _leave_idle(self, worker: _Worker) -> None:
        """The worker is no longer available for jobs: cancel its idle timer, drop it from
        the idle list (safe to call for a worker that is neither)."""
        if worker.idle_timer is not None:
            worker.idle_timer.cancel()
            worker.idle_timer = None
        if worker in self._idle:
            self._idle.remove(worker)

    def _retire(self, worker: _Worker) -> None:
        worker.idle_timer = None
        if worker.state is _State.IDLE:
            self._idle.remove(worker)
            logger.debug("worker %d idle for %.1f s: stopping it", worker.id, self.idle_s)
            self._stop(worker)

    def _stop(self, worker: _Worker) -> None:
        if worker.stop_sent:
            return
        worker.stop_sent = True
        self._leave_idle(worker)
        if worker.state is _State.IDLE:
            worker.state = _State.STOPPING
        if worker.state is _State.STARTING:
            self._starting -= 1
            worker.state = _State.STOPPING
        try:
            worker.conn.send(None)  # a busy worker reads it after its job
        except OSError:
            pass  # already gone; its sentinel says so


__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_PRELOAD", "ProcessBackend"]
