"""The worker process of :class:`~murmura.server.process_backend.ProcessBackend`: how it starts
warm, its loop, running one job, and the error format on the pipe back to the gateway.

The worker's code is kept apart from the parent's bookkeeping so that a forkserver preloads
just this (and what the jobs need, see :data:`DEFAULT_PRELOAD`), and so that what crosses the
pipe is defined in one place: ``(job_id, payload)`` in, ``("ready", pid)`` and
``("done", job_id, ok, blob, started)`` out, ``None`` to stop, an exception as
:func:`_pack_error` writes it and :func:`_unpack_error` (on the gateway's side) reads it.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from murmura.server import slabs
from murmura.server.workers import RemoteError, _describe, _RemoteTraceback

# -- starting warm ---------------------------------------------------------------------------

#: Modules a forkserver imports once, so a cold start forks a warm interpreter instead of
#: importing torch again (``__main__`` too: without it every child re-imports the main script).
DEFAULT_PRELOAD: tuple[str, ...] = (
    "__main__", "murmura.server.worker_process", "murmura.protocols", "murmura.aggregation",
)

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


# -- an exception on the pipe: packed in the worker, unpacked by the gateway -----------------


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


# -- in the worker ---------------------------------------------------------------------------


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
