"""The aggregation functions as Ray tasks, for a server whose functions run on a Ray cluster.

Ray may run a task on another machine, where the gateway's shared memory does not exist. So the
slab convention of :mod:`murmura.server.slabs` is applied here, in the gateway process:

* an input :class:`~murmura.server.slabs.SlabRef` argument is replaced by its bytes (a uint8
  array, which Ray puts in its object store without pickling it), and the function reads either
  form with :func:`~murmura.server.slabs.resolve`;
* an output :class:`~murmura.server.slabs.OutRef` argument (at most one) is replaced by
  ``None``; the function, ending with :func:`~murmura.server.slabs.write_out`, then returns an
  :class:`~murmura.server.slabs.OutArray`, whose array is copied into the slab here, and
  :meth:`RayBackend.run` returns the small result, as every other backend does.

Only top-level arguments (positional and keyword) are converted. Ray is an optional dependency
and is imported when a backend is made, never when this module is.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from murmura.server.slabs import OutArray, OutRef, SlabRef, attach, copy_into
from murmura.server.workers import (
    BackendClosed,
    FunctionBackend,
    QueueFull,
    WorkerCrashed,
    _describe,
    _RemoteTraceback,
)

logger = logging.getLogger(__name__)

RAY_MISSING = 'Ray is not installed: pip install "murmura[ray]"'


def init_ray(ray: Any, *args: Any, **kwargs: Any) -> None:
    """``ray.init(*args, **kwargs)``, keeping this process's SIGINT and SIGTERM handlers.

    Why: ``ray.init`` replaces them with its own (a SIGTERM then exits with status 15, after a
    native stack dump), so a server or simulation stopped by a service manager skipped its
    graceful shutdown: no final metrics, no summary, the durable state closed by a kill.
    Also quiets ``ray.init``'s FutureWarning tips about future defaults.
    """
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(*args, **kwargs)
    for sig, handler in saved.items():
        if handler is not None:  # None: set outside Python, nothing of ours to restore
            signal.signal(sig, handler)


def _ray_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The Ray task: one generic function, so any module-level function runs without being
    registered with Ray first."""
    return fn(*args, **kwargs)


class RayBackend(FunctionBackend):
    """Runs each function as a Ray task.

    ``address=None`` starts a local Ray (``ray.init("local", **init_kwargs)``) that
    :meth:`close` shuts down; an address connects to that cluster and :meth:`close`
    disconnects. If Ray is already initialised in this process, that session is used and left
    running. At most ``max_in_flight`` tasks run or wait in Ray at once; beyond that
    :meth:`run` raises :class:`~murmura.server.workers.QueueFull`. A task whose Ray worker dies
    is retried by Ray, ``max_attempts`` runs in all, then :meth:`run` raises
    :class:`~murmura.server.workers.WorkerCrashed`; an exception raised by the function is its
    answer and is re-raised as it is.
    """

    def __init__(self, address: str | None = None, *, max_in_flight: int = 64,
                 max_attempts: int = 3, **init_kwargs: Any) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError(RAY_MISSING) from None
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._ray = ray
        self.max_in_flight = max_in_flight
        self.max_attempts = max_attempts
        self._owns = not ray.is_initialized()
        if self._owns:
            init_kwargs.setdefault("include_dashboard", False)
            init_ray(ray, "local" if address is None else address, **init_kwargs)
            logger.info("Ray started%s", "" if address is None else f" (connected to {address})")
        elif address is not None or init_kwargs:
            raise RuntimeError("Ray is already initialised in this process; RayBackend() with "
                               "no address or options uses that session")
        self._task = ray.remote(max_retries=max_attempts - 1, retry_exceptions=False)(_ray_call)
        self._crash_errors = tuple(getattr(ray.exceptions, name) for name in (
            "WorkerCrashedError", "OutOfMemoryError", "NodeDiedError", "LocalRayletDiedError")
            if hasattr(ray.exceptions, name))
        self._closed = False
        self._in_flight = 0
        self.jobs_submitted = 0
        self.jobs_done = 0
        self.jobs_failed = 0
        self.rejected = 0
        self.crashes = 0
        self._latency_total_s = 0.0

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise BackendClosed("the Ray backend is closed")
        if self._in_flight >= self.max_in_flight:
            self.rejected += 1
            raise QueueFull(f"{self._in_flight} Ray tasks in flight "
                            f"(max_in_flight={self.max_in_flight}); retry shortly")
        name = _describe(fn)
        outs: list[OutRef] = []
        shipped_args = tuple(self._ship(a, outs) for a in args)
        shipped_kwargs = {k: self._ship(v, outs) for k, v in kwargs.items()}
        if len(outs) > 1:
            raise ValueError(f"{name} was given {len(outs)} OutRef arguments; at most one")
        self._in_flight += 1
        self.jobs_submitted += 1
        submitted = time.monotonic()
        try:
            ref = self._task.remote(fn, shipped_args, shipped_kwargs)
            try:
                result = await ref
            except asyncio.CancelledError:
                self._ray.cancel(ref)
                raise
            except self._ray.exceptions.RayTaskError as exc:
                self.jobs_failed += 1
                cause = exc.cause
                if isinstance(cause, Exception) and not isinstance(
                        cause, self._ray.exceptions.RayError):
                    if cause.__cause__ is None:
                        cause.__cause__ = _RemoteTraceback(str(exc))  # Ray's remote traceback
                    raise cause from cause.__cause__
                raise
            except self._crash_errors as exc:
                self.crashes += 1
                raise WorkerCrashed(f"{name}: the Ray worker running it died on all "
                                    f"{self.max_attempts} attempts ({exc})") from exc
            if outs:
                if not isinstance(result, OutArray):
                    raise TypeError(
                        f"{name} ran remotely with out=None and must return "
                        f"write_out(out, array, result), not {type(result).__name__}")
                copy_into(outs[0], result.array)
                result = result.result
            self.jobs_done += 1
            self._latency_total_s += time.monotonic() - submitted
            return result
        finally:
            self._in_flight -= 1

    @staticmethod
    def _ship(value: Any, outs: list[OutRef]) -> Any:
        if isinstance(value, OutRef):
            outs.append(value)
            return None
        if isinstance(value, SlabRef):
            return np.frombuffer(attach(value), dtype=np.uint8)  # copied into Ray at submit
        return value

    def stats(self) -> dict[str, Any]:
        done = self.jobs_done
        return {
            "backend": "ray",
            "max_in_flight": self.max_in_flight,
            "in_flight": self._in_flight,
            "jobs_submitted": self.jobs_submitted,
            "jobs_done": done,
            "jobs_failed": self.jobs_failed,
            "rejected": self.rejected,
            "crashes": self.crashes,
            "round_trip_mean_s": self._latency_total_s / done if done else None,
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
            logger.info("Ray shut down")


__all__ = ["init_ray", "RAY_MISSING", "RayBackend"]
