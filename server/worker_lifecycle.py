"""What :class:`~murmura.server.process_backend.ProcessBackend` does when one of its worker
processes starts, answers or exits, and the records it keeps of workers and jobs.

The backend's own module decides *which* job runs *where* (the queue, dispatch, scaling up,
retiring idle workers). This one holds the events that drive those decisions: a process is
started on the helper thread and watched on the event loop (its pipe and its sentinel), its
"ready" and "done" messages are accounted for, and a process that exits is reaped, its job
answered or run again. :class:`WorkerLifecycle` is mixed into the backend and shares its
state; all of it runs on the loop thread, except the start and the join of a process.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import pickle
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from murmura.server.worker_process import _unpack_error, _worker_main
from murmura.server.workers import BackendClosed, RemoteError, WorkerCrashed

logger = logging.getLogger(__name__)


class _State(enum.Enum):
    STARTING = "starting"  # process being started, or started and not yet ready
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"  # told to stop; exits when its current job (if any) is done
    EXITED = "exited"      # its sentinel fired; being reaped


@dataclass(eq=False)
class _Job:
    id: int
    name: str
    payload: bytes
    future: asyncio.Future[Any]
    submitted: float
    attempts: int = 0
    warm: bool = False
    exit_codes: list[int | None] = field(default_factory=list)


@dataclass(eq=False)
class _Worker:
    id: int
    process: Any  # a multiprocessing context's Process
    conn: Connection
    child_conn: Connection
    exited: asyncio.Future[int | None]
    spawned: float = 0.0
    state: _State = _State.STARTING
    state_before_exit: _State = _State.STARTING
    job: _Job | None = None
    idle_timer: asyncio.TimerHandle | None = None
    reading: bool = False
    stop_sent: bool = False
    dead: bool = False  # its sentinel fired
    jobs: int = 0
    pid: int | None = None


class WorkerLifecycle:
    """Worker processes' events: start, messages, exit and reaping (mixed into
    :class:`~murmura.server.process_backend.ProcessBackend`, whose ``__init__`` sets the
    state below)."""

    max_attempts: int
    max_message_bytes: int
    start_method: str
    _ctx: Any
    _loop: asyncio.AbstractEventLoop | None
    _procs: ThreadPoolExecutor | None
    _workers: dict[int, _Worker]
    _queue: deque[_Job]
    _starting: int
    _tasks: set[asyncio.Task[Any]]
    _worker_ids: itertools.count[int]
    _closed: bool
    _start_failures: int
    _last_start_error: str
    # counters
    jobs_done: int
    jobs_failed: int
    cold_starts: int
    crashes: int
    retries: int
    stops: int
    _cold_total_s: float
    _cold_last_s: float
    _latency_total_s: float
    _warm_latency_total_s: float
    _warm_latency_n: int

    if TYPE_CHECKING:  # the backend's scheduling, which these events drive
        def _ensure_capacity(self) -> None: ...
        def _pump(self) -> None: ...
        def _next_job(self, worker: _Worker, *, warm: bool) -> None: ...
        def _leave_idle(self, worker: _Worker) -> None: ...

    def _spawn(self) -> None:
        loop = self._loop
        assert loop is not None
        conn, child_conn = self._ctx.Pipe(duplex=True)
        wid = next(self._worker_ids)
        process = self._ctx.Process(target=_worker_main, args=(child_conn, self.max_message_bytes),
                                    name=f"murmura-fn-{wid}", daemon=True)
        worker = _Worker(wid, process, conn, child_conn, loop.create_future(),
                         spawned=time.monotonic())
        self._workers[wid] = worker
        self._starting += 1
        self._track(loop.create_task(self._start(worker)))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, worker: _Worker) -> None:
        loop = self._loop
        assert loop is not None
        try:
            await loop.run_in_executor(self._procs, worker.process.start)
        except Exception as exc:
            logger.error("could not start a worker process: %s", exc)
            worker.child_conn.close()
            worker.conn.close()
            self._workers.pop(worker.id, None)
            if worker.state is _State.STARTING:
                self._starting -= 1
            worker.state = _State.EXITED
            worker.exited.set_result(None)
            self._start_failures += 1
            self._last_start_error = f"{type(exc).__name__}: {exc}"
            self._ensure_capacity()
            return
        worker.child_conn.close()
        worker.pid = worker.process.pid
        logger.debug("worker %d started (pid %s, %s)", worker.id, worker.pid, self.start_method)
        worker.reading = True
        loop.add_reader(worker.conn.fileno(), self._on_readable, worker)
        loop.add_reader(worker.process.sentinel, self._on_exit, worker)

    def _on_readable(self, worker: _Worker) -> None:
        # One message per wake-up: the loop's reader is level-triggered, so a second message
        # already in the pipe wakes it again (Connection.poll builds a selector per call,
        # which cost more than the message on a busy gateway).
        try:
            if worker.reading:
                self._handle(worker, worker.conn.recv())
        except (EOFError, OSError):
            # The pipe closed: the worker is exiting or dead; its sentinel does the rest.
            self._stop_reading(worker)

    def _stop_reading(self, worker: _Worker) -> None:
        if worker.reading:
            worker.reading = False
            assert self._loop is not None
            self._loop.remove_reader(worker.conn.fileno())

    def _handle(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            elapsed = time.monotonic() - worker.spawned
            self.cold_starts += 1
            self._cold_total_s += elapsed
            self._cold_last_s = elapsed
            self._start_failures = 0
            logger.debug("worker %d ready after %.3f s (cold start)", worker.id, elapsed)
            if worker.state is _State.STARTING:
                self._starting -= 1
                if worker.dead:
                    worker.state = _State.STOPPING
                else:
                    self._next_job(worker, warm=False)
            return
        _, job_id, ok, blob, started = message
        job = worker.job
        if job is None or job.id != job_id:
            logger.error("worker %d answered job %s it was not running", worker.id, job_id)
            return
        worker.job = None
        worker.jobs += 1
        self.jobs_done += 1
        latency = max(0.0, started - job.submitted)
        self._latency_total_s += latency
        if job.warm:
            self._warm_latency_total_s += latency
            self._warm_latency_n += 1
        if not ok:
            self.jobs_failed += 1
        if not job.future.done():
            if ok:
                try:
                    job.future.set_result(pickle.loads(blob))
                except Exception as exc:
                    job.future.set_exception(RemoteError(
                        f"the result of {job.name} does not unpickle here: {exc}"))
            else:
                job.future.set_exception(_unpack_error(blob))
        if worker.stop_sent or worker.dead:
            worker.state = _State.STOPPING
        else:
            self._next_job(worker, warm=True)

    def _on_exit(self, worker: _Worker) -> None:
        """The worker's sentinel fired: it is dead. Read what it sent before dying, then reap it
        on the process thread and account for it."""
        assert self._loop is not None
        self._loop.remove_reader(worker.process.sentinel)
        worker.dead = True
        self._on_readable(worker)  # a result it sent just before dying still counts
        self._stop_reading(worker)
        worker.conn.close()
        self._leave_idle(worker)
        if worker.state is _State.STARTING:
            self._starting -= 1
        worker.state_before_exit = worker.state
        worker.state = _State.EXITED
        self._track(self._loop.create_task(self._reap(worker)))

    async def _reap(self, worker: _Worker) -> None:
        assert self._loop is not None
        code = await self._loop.run_in_executor(self._procs, _join, worker.process)
        self._workers.pop(worker.id, None)
        if (worker.stop_sent and worker.job is None) or self._closed:
            self.stops += 1
            logger.debug("worker %d stopped (exit code %s) after %d jobs", worker.id, code,
                         worker.jobs)
        else:
            self.crashes += 1
            if worker.state_before_exit is _State.STARTING:
                self._start_failures += 1
                self._last_start_error = f"exit code {code}"
            logger.warning("worker %d (pid %s) died with exit code %s%s", worker.id,
                           worker.pid, code,
                           f" running {worker.job.name}" if worker.job else "")
        job, worker.job = worker.job, None
        if job is not None and not job.future.done():
            job.exit_codes.append(code)
            if self._closed:
                job.future.set_exception(BackendClosed(
                    f"the process backend was closed while {job.name} ran"))
            elif job.attempts >= self.max_attempts:
                job.future.set_exception(WorkerCrashed(
                    f"{job.name}: the worker running it died on all {job.attempts} attempts "
                    f"(exit codes {job.exit_codes}; negative = killed by that signal)"))
            else:
                self.retries += 1
                logger.info("re-running %s (attempt %d of %d)", job.name, job.attempts + 1,
                            self.max_attempts)
                self._queue.appendleft(job)
        worker.exited.set_result(code)
        self._pump()


def _join(process: Any) -> int | None:
    process.join(timeout=10.0)
    code: int | None = process.exitcode
    if code is not None:
        process.close()  # its sentinel and pipe fds
    return code
