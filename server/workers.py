"""Function backends: where the aggregation functions (decode + validate an update) run.

The gateway calls ``await backend.run(fn, *args)`` with a module-level function and small
arguments (payloads travel as :class:`~murmura.server.slabs.SlabRef`), and gets the function's
result or its exception back. This module is that interface (:class:`FunctionBackend`), the
errors every backend raises, and the backend without processes. Three backends share it:

* :class:`InlineBackend` runs the function in the calling thread (``--workers 0``: tests, tiny
  runs, the simulator);
* ``murmura.server.process_backend.ProcessBackend`` runs it in worker processes that exist
  only while there is work, in the shape of LIFL's aggregation functions (Qi, Ramakrishnan &
  Lee, MLSys 2024, https://arxiv.org/abs/2405.10968): a job that finds no idle worker starts
  one (up to a cap) or queues, a worker idle for ``idle_s`` stops, so an idle server has no
  worker process and uses no CPU;
* ``murmura.server.raybackend.RayBackend`` runs it as a Ray task.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


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

    async def run_now(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`run` for work already promised (a fold of an accepted update): a backend
        with a bounded queue must neither refuse it nor queue it behind ordinary jobs."""
        return await self.run(fn, *args, **kwargs)

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


__all__ = [
    "BackendClosed",
    "FunctionBackend",
    "InlineBackend",
    "QueueFull",
    "RemoteError",
    "WorkerCrashed",
    "default_max_workers",
]
