"""Test support: module-level job functions for the function backends' tests and benchmarks.

They live in the package (not under ``tests/``) because worker processes unpickle a job's
function by reference, so its module must import there (forkserver and spawn children, Ray
workers) wherever the tests run from. Nothing in the server uses them.

Jobs that must be observed while running use a *control slab* (:class:`Control`): per slot,
the number of times a job started, the pid of the process running it, and a release flag the
test sets to let it finish.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np

from murmura.protocols import CodecError
from murmura.server.slabs import OutRef, Slab, SlabRef, attach, resolve, write_out

SLOTS = 64
_STARTED, _PID, _RELEASE = 0, SLOTS, 2 * SLOTS
CONTROL_BYTES = 3 * SLOTS * 4


def _control(ref: SlabRef) -> np.ndarray:
    return np.frombuffer(attach(ref), dtype=np.int32, count=3 * SLOTS)


class Control:
    """The test's side of a control slab (at least :data:`CONTROL_BYTES`, zeroed here)."""

    def __init__(self, slab: Slab) -> None:
        self.ref = slab.ref(0, CONTROL_BYTES)
        self._a = np.frombuffer(slab.buf, dtype=np.int32, count=3 * SLOTS)
        self._a[:] = 0

    def started(self, slot: int) -> int:
        return int(self._a[_STARTED + slot])

    def pid(self, slot: int) -> int:
        return int(self._a[_PID + slot])

    def release(self, slot: int) -> None:
        self._a[_RELEASE + slot] = 1

    def close(self) -> None:
        """Drop the view (a slab with a live view cannot be closed cleanly)."""
        del self._a


def hold(ctrl: SlabRef, slot: int, *, block_attempts: int = 1,
         timeout_s: float = 30.0) -> tuple[int, int]:
    """Record a start (count, pid) in ``slot``; the first ``block_attempts`` starts then wait
    until the test releases the slot. Returns (pid, attempt)."""
    a = _control(ctrl)
    a[_STARTED + slot] += 1
    attempt = int(a[_STARTED + slot])
    a[_PID + slot] = os.getpid()
    deadline = time.monotonic() + timeout_s
    while attempt <= block_attempts and not a[_RELEASE + slot]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"slot {slot} was not released within {timeout_s} s")
        time.sleep(0.002)
    return os.getpid(), attempt


def answer_then_die(ctrl: SlabRef, slot: int, *, timeout_s: float = 30.0) -> int:
    """Record a start, wait for the release, return the pid and have the process SIGKILLed a
    moment later (after the answer is on its way)."""
    a = _control(ctrl)
    a[_STARTED + slot] += 1
    a[_PID + slot] = os.getpid()
    deadline = time.monotonic() + timeout_s
    while not a[_RELEASE + slot]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"slot {slot} was not released within {timeout_s} s")
        time.sleep(0.002)
    threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return os.getpid()


def add(a: float, b: float) -> float:
    return a + b


def getpid() -> int:
    return os.getpid()


def scale_into(src: SlabRef | bytes, out: OutRef | None, factor: float) -> float:
    """A decode-shaped job: float32 values from ``src`` times ``factor`` into ``out``; returns
    their sum. Written the way the real decode function is (:func:`resolve`, :func:`write_out`)
    so it runs unchanged on every backend."""
    data = resolve(src)
    if len(data) % 4:
        raise CodecError(f"a float32 payload needs a multiple of 4 bytes, got {len(data)}")
    values = np.frombuffer(data, dtype=np.float32) * np.float32(factor)
    return write_out(out, values, float(values.sum(dtype=np.float64)))


def ignores_out(out: OutRef | None) -> str:
    """Breaks the output convention: never writes ``out`` nor returns an OutArray."""
    return "no array"


def fail(message: str) -> None:
    raise CodecError(message)


class StubbornError(Exception):
    """An exception that pickles but cannot be rebuilt from its args (two required args)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def fail_stubborn() -> None:
    raise StubbornError("payload", "cannot be rebuilt")


def kill_self() -> None:
    """Die the way an out-of-memory kill does: SIGKILL, no cleanup."""
    os.kill(os.getpid(), signal.SIGKILL)


def unpicklable_result() -> Any:
    return lambda: None


__all__ = ["CONTROL_BYTES", "Control", "SLOTS", "add", "answer_then_die", "copy_or_die", "fail",
           "fail_stubborn",
           "getpid", "hold", "ignores_out", "kill_self", "scale_into", "unpicklable_result"]


def copy_or_die(arrays: Any, params: tuple[str, str], out: np.ndarray | None,
                a: int, b: int) -> None:
    """A column kernel (server/columns.py): ``out[a:b] = src[a:b] * 2``; its process is
    SIGKILLed halfway through when ``params[0]`` exists (the file is removed first, so only
    the first attempt dies), and it raises when ``params[1]`` exists."""
    die_if, fail_if = params
    assert out is not None
    mid = (a + b) // 2
    out[a:mid] = arrays["src"][a:mid] * 2
    if os.path.exists(fail_if):
        raise RuntimeError("a kernel that fails")
    try:
        os.remove(die_if)
    except FileNotFoundError:
        pass
    else:
        os.kill(os.getpid(), signal.SIGKILL)
    out[mid:b] = arrays["src"][mid:b] * 2
