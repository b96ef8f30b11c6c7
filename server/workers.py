"""Function backends: where the aggregation functions (decode + validate an update) run.

The gateway calls ``await backend.run(fn, *args)`` with a module-level function and small
arguments (payloads travel as :class:`~murmura.server.slabs.SlabRef`), and gets the function's
result or its exception back. Three backends share that interface:

* :class:`InlineBackend` runs the function in the calling thread (``--workers 0``: tests, tiny
  runs, the simulator);
* :class:`ProcessBackend` runs it in worker processes that exist only while there is work, in
  the shape of LIFL's aggregation functions (Qi, Ramakrishnan & Lee, MLSys 2024,
  https://arxiv.org/abs/2405.10968): a job that finds no idle worker starts one (up to a cap)
  or queues, a worker idle for ``idle_s`` stops, so an idle server has no worker process and
  uses no CPU;
* ``murmura.server.raybackend.RayBackend`` runs it as a Ray task.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import logging
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from multiprocessing.connection import Connection
from typing import Any

from murmura.server import slabs

logger = logging.getLogger(__name__)

#: Modules a forkserver imports once, so a cold start forks a warm interpreter instead of
#: importing torch again (``__main__`` too: without it every child re-imports the main script).
DEFAULT_PRELOAD: tuple[str, ...] = (
    "__main__", "murmura.server.workers", "murmura.protocols", "murmura.aggregation",
)
#: A pickled job or result larger than this is refused: bulk data belongs in a slab.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20


class QueueFull(Exception):
    """Every worker is busy and ``max_queue`` jobs already wait: retry later
    (the gateway answers RESOURCE_EXHAUSTED with a retry hint)."""


class WorkerCrashed(Exception):
    """The worker processes running a job died (killed, out of memory, a segfault) on every one
    of its ``max_attempts`` attempts."""


class BackendClosed(RuntimeError):
    """The backend was closed before the job could run or finish."""


class RemoteError(Exception):
    """A job failed with an exception that could not be sent back as itself (it does not
    pickle, or cannot be rebuilt here); the message names its type."""


class _RemoteTraceback(Exception):
    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb}\"\"\""


def default_max_workers() -> int:
    """Cores this process may use, less one for the gateway's event loop; at least 1."""
    if hasattr(os, "process_cpu_count"):
        cores = os.process_cpu_count() or 1
    elif hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class FunctionBackend(ABC):
    """Runs module-level functions somewhere and hands their results back to an event loop.

    ``fn`` must be picklable by reference (a module-level function of an importable module).
    An exception raised by ``fn`` is the job's answer and is re-raised by :meth:`run` as it is;
    only infrastructure failures are retried.
    """

    @abstractmethod
    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, run by this backend."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for logs and metrics."""

    @abstractmethod
    async def close(self) -> None:
        """Release every process and resource; later :meth:`run` calls raise BackendClosed."""

    async def __aenter__(self) -> FunctionBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class InlineBackend(FunctionBackend):
    """Runs the function in the calling thread, blocking it (``--workers 0``).

    Arguments are passed as they are: a function reads a ``SlabRef`` with
    :func:`murmura.server.slabs.resolve`, which in the pool's own process is a view of the
    pool's mapping, so the inline path copies nothing either.
    """

    def __init__(self) -> None:
        self._closed = False
        self.jobs_done = 0
        self.jobs_failed = 0

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise BackendClosed("the inline backend is closed")
        self.jobs_done += 1
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.jobs_failed += 1
            raise

    def stats(self) -> dict[str, Any]:
        return {"backend": "inline", "jobs_done": self.jobs_done, "jobs_failed": self.jobs_failed}

    async def close(self) -> None:
        self._closed = True


# -- the worker process ----------------------------------------------------------------------


def _pack_error(exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    blob: bytes | None = None
    if isinstance(exc, Exception):
        try:
            blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an unpicklable attribute: send its type and message instead
            blob = None
    return pickle.dumps((blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb))


def _unpack_error(data: bytes) -> BaseException:
    blob, type_name, message, tb = pickle.loads(data)
    exc: BaseException
    try:
        exc = pickle.loads(blob) if blob is not None else RemoteError(f"{type_name}: {message}")
    except Exception:  # it pickled there but does not rebuild here (e.g. required __init__ args)
        exc = RemoteError(f"{type_name}: {message}")
    if exc.__cause__ is None:
        exc.__cause__ = _RemoteTraceback(tb)
    return exc


def _execute(payload: bytes, max_result_bytes: int) -> tuple[bool, bytes]:
    name = "the job"
    try:
        fn, args, kwargs = pickle.loads(payload)
        name = _describe(fn)
        result = fn(*args, **kwargs)
    except Exception as exc:
        return False, _pack_error(exc)
    except BaseException as exc:  # SystemExit and friends must not end the worker or the gateway
        return False, _pack_error(RemoteError(f"{name} raised {type(exc).__name__}: {exc}"))
    try:
        blob = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return False, _pack_error(TypeError(f"the result of {name} does not pickle: {exc}"))
    if len(blob) > max_result_bytes:
        return False, _pack_error(ValueError(
            f"the result of {name} is {len(blob)} bytes pickled (limit {max_result_bytes}); "
            "write bulk output into an OutRef slab"))
    return True, blob


def _worker_main(conn: Connection, max_result_bytes: int) -> None:
    """A worker's whole life: say ready, run jobs until told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it stops us
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the parent died
            if message is None:
                return
            job_id, payload = message
            started = time.monotonic()
            ok, blob = _execute(payload, max_result_bytes)
            try:
                conn.send(("done", job_id, ok, blob, started))
            except OSError:
                return
    finally:
        slabs.detach_all()
        conn.close()


# -- the parent's side -----------------------------------------------------------------------


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


_PRELOAD: set[str] = set()


def _request_preload(ctx: Any, modules: tuple[str, ...]) -> None:
    """Add ``modules`` to the forkserver's preload list.

    The forkserver is one per Python process whatever context object is used (its preload list
    is module state of ``multiprocessing.forkserver``), and reads the list once, when it starts.
    So every backend adds to one shared list; a forkserver started earlier keeps what it had.
    """
    for name in modules:
        if name != "__main__" and importlib.util.find_spec(name) is None:
            raise ValueError(f"preload module {name!r} cannot be imported")
    _PRELOAD.update(modules)
    ctx.set_forkserver_preload(sorted(_PRELOAD, key=lambda m: (m != "__main__", m)))


class ProcessBackend(FunctionBackend):
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
            if not can_start and len(self._queue) - self._starting >= self.max_queue:
                self.rejected += 1
                raise QueueFull(
                    f"all {self.max_workers} workers are busy and {len(self._queue)} jobs wait "
                    f"(max_queue={self.max_queue}); retry shortly")
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

    # -- processes --------------------------------------------------------------------------

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
        try:
            while worker.reading and worker.conn.poll():
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


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PRELOAD",
    "BackendClosed",
    "FunctionBackend",
    "InlineBackend",
    "ProcessBackend",
    "QueueFull",
    "RemoteError",
    "WorkerCrashed",
    "default_max_workers",
]
