"""Function backends (server/workers.py) with real worker processes and shared memory: scaling
from zero and back, warm reuse, back-pressure, exceptions as answers, crash recovery, clean
shutdown, and no segment or process left behind.

Job functions live in ``murmura.server._testjobs`` so the workers can import them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from murmura.protocols import CodecError
from murmura.server import _testjobs as jobs
from murmura.server.process_backend import ProcessBackend
from murmura.server.workers import (
    BackendClosed,
    FunctionBackend,
    InlineBackend,
    QueueFull,
    RemoteError,
    WorkerCrashed,
    default_max_workers,
)
from tests.server.conftest import needs_dev_shm, shm_names

TIMEOUT_S = 60.0


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a test coroutine on a fresh loop, with a deadline so a bug cannot hang the suite."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait for ``condition`` with a deadline (polling the loop, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def gone(pid: int) -> bool:
    """The process no longer exists, not even as a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@asynccontextmanager
async def process_backend(max_workers: int = 2, **kwargs: Any) -> AsyncIterator[ProcessBackend]:
    backend = ProcessBackend(max_workers, **kwargs)
    try:
        yield backend
    finally:
        await backend.close(grace_s=2.0)
        assert backend.stats()["workers"] == 0


def started(task: Awaitable[Any]) -> asyncio.Task[Any]:
    return asyncio.ensure_future(task)


# -- the contract every backend keeps ---------------------------------------------------------


class BackendContract:
    """One suite for every backend; subclasses say how to open one."""

    __test__ = False

    def open(self) -> Any:  # an async context manager yielding a FunctionBackend
        raise NotImplementedError

    def test_returns_the_function_result(self) -> None:
        async def go() -> None:
            async with self.open() as backend:
                assert await backend.run(jobs.add, 2, b=3) == 5
                assert backend.stats()["jobs_done"] >= 1

        run(go())

    def test_reads_an_input_slab_and_writes_an_output_slab(self, make_pool) -> None:
        pool = make_pool()
        values = np.linspace(-1, 1, 1000, dtype=np.float32)
        src, dst = pool.acquire(values.nbytes), pool.acquire(values.nbytes)
        assert src is not None and dst is not None
        np.frombuffer(src.buf, np.float32, count=values.size)[:] = values

        async def go() -> float:
            async with self.open() as backend:
                return await backend.run(jobs.scale_into, src.ref(), dst.out_ref(), 3.0)

        total = run(go())
        out = np.frombuffer(dst.buf, np.float32, count=values.size)
        assert np.array_equal(out, values * np.float32(3.0))
        assert total == pytest.approx(float((values * 3).sum()), abs=1e-3)
        del out

    def test_the_functions_exception_is_the_answer(self) -> None:
        async def go() -> None:
            async with self.open() as backend:
                with pytest.raises(CodecError, match="^bad payload: 3 bytes$"):
                    await backend.run(jobs.fail, "bad payload: 3 bytes")
                assert await backend.run(jobs.add, 1, 1) == 2  # the backend carries on
                stats = backend.stats()
                assert stats.get("retries", 0) == 0 and stats.get("crashes", 0) == 0

        run(go())


class TestInlineBackend(BackendContract):
    __test__ = True

    def open(self) -> Any:
        @asynccontextmanager
        async def cm() -> AsyncIterator[FunctionBackend]:
            async with InlineBackend() as backend:
                yield backend

        return cm()

    def test_runs_in_the_calling_process_and_refuses_after_close(self) -> None:
        async def go() -> None:
            backend = InlineBackend()
            assert await backend.run(jobs.getpid) == os.getpid()
            await backend.close()
            with pytest.raises(BackendClosed):
                await backend.run(jobs.add, 1, 2)

        run(go())


@pytest.mark.integration
class TestProcessBackendContract(BackendContract):
    __test__ = True

    def open(self) -> Any:
        return process_backend(1)


# -- ProcessBackend ---------------------------------------------------------------------------


def test_default_max_workers_leaves_a_core_for_the_gateway() -> None:
    assert 1 <= default_max_workers() <= max(1, (os.cpu_count() or 1) - 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_workers": 0}, "max_workers must be >= 1"),
    ({"max_workers": 1, "idle_s": 0}, "idle_s must be > 0"),
    ({"max_workers": 1, "max_queue": -1}, "max_queue must be >= 0"),
    ({"max_workers": 1, "max_attempts": 0}, "max_attempts must be >= 1"),
    ({"max_workers": 1, "start_method": "fork"}, "'forkserver' or 'spawn'"),
    ({"max_workers": 1, "preload": ("murmura.no_such_module",)}, "cannot be imported"),
])
def test_bad_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProcessBackend(**kwargs)


@pytest.mark.integration
def test_scales_from_zero_to_max_and_back_to_zero_when_idle(make_pool) -> None:
    ctrl_slab = make_pool().acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        async with process_backend(2, idle_s=0.3) as backend:
            assert backend.stats()["workers"] == 0  # nothing until the first job
            a = started(backend.run(jobs.hold, ctrl.ref, 0))
            b = started(backend.run(jobs.hold, ctrl.ref, 1))
            await until(lambda: ctrl.started(0) and ctrl.started(1), "two jobs running")
            stats = backend.stats()
            assert stats["workers"] == 2 and stats["busy"] == 2 and stats["cold_starts"] == 2
            c = started(backend.run(jobs.hold, ctrl.ref, 2))
            await until(lambda: backend.stats()["queue_depth"] == 1, "the third job queued")
            assert backend.stats()["workers"] == 2  # at the cap: it waits, no third process
            for slot in range(3):
                ctrl.release(slot)
            (pid_a, _), (pid_b, _), (pid_c, _) = await asyncio.gather(a, b, c)
            assert pid_a != pid_b and pid_c in (pid_a, pid_b)  # the third ran warm
            await until(lambda: backend.stats()["workers"] == 0, "idle workers to stop")
            stats = backend.stats()
            assert stats["stops"] == 2 and stats["crashes"] == 0 and stats["jobs_done"] == 3
            assert stats["warm_dispatches"] == 1 and stats["cold_dispatches"] == 2
            assert gone(pid_a) and gone(pid_b)  # exited and reaped
            assert await backend.run(jobs.add, 1, 1) == 2  # and it scales up again
            assert backend.stats()["cold_starts"] == 3

    run(go())
    ctrl.close()


@pytest.mark.integration
def test_a_second_job_reuses_the_warm_worker() -> None:
    async def go() -> None:
        async with process_backend(2) as backend:
            await backend.warm_up()  # the forkserver only: no worker yet
            assert backend.stats()["workers"] == 0
            first = await backend.run(jobs.getpid)
            second = await backend.run(jobs.getpid)
            stats = backend.stats()
            assert first == second != os.getpid()
            assert stats["cold_starts"] == 1 and stats["warm_dispatches"] == 1
            assert stats["cold_start_last_s"] > 0 and stats["warm_dispatch_latency_mean_s"] >= 0

    run(go())


@pytest.mark.integration
def test_a_full_queue_refuses_at_once_and_drops_nothing(make_pool) -> None:
    ctrl_slab = make_pool().acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        async with process_backend(1, max_queue=2) as backend:
            running = started(backend.run(jobs.hold, ctrl.ref, 0))
            await until(lambda: ctrl.started(0) == 1, "the first job running")
            waiting = [started(backend.run(jobs.hold, ctrl.ref, s)) for s in (1, 2)]
            await until(lambda: backend.stats()["queue_depth"] == 2, "two jobs queued")
            with pytest.raises(QueueFull, match="max_queue=2"):
                await backend.run(jobs.add, 1, 2)
            assert backend.stats()["rejected"] == 1
            for slot in range(3):
                ctrl.release(slot)
            results = await asyncio.gather(running, *waiting)
            assert [attempt for _, attempt in results] == [1, 1, 1]
            assert backend.stats()["jobs_done"] == 3 and backend.stats()["queue_depth"] == 0

    run(go())
    ctrl.close()


@pytest.mark.integration
def test_a_cancelled_queued_job_leaves_the_queue(make_pool) -> None:
    ctrl_slab = make_pool().acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        async with process_backend(1) as backend:
            running = started(backend.run(jobs.hold, ctrl.ref, 0))
            await until(lambda: ctrl.started(0) == 1, "the first job running")
            queued = started(backend.run(jobs.hold, ctrl.ref, 1))
            await until(lambda: backend.stats()["queue_depth"] == 1, "a job queued")
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert backend.stats()["queue_depth"] == 0
            ctrl.release(0)
            await running
            assert ctrl.started(1) == 0  # the cancelled job never ran

    run(go())
    ctrl.close()


@pytest.mark.integration
def test_exceptions_that_cannot_travel_and_jobs_that_cannot_be_sent() -> None:
    async def go() -> None:
        async with process_backend(1) as backend:
            with pytest.raises(TypeError, match="module-level"):
                await backend.run(lambda: 1)
            with pytest.raises(ValueError, match="pass bulk data as a SlabRef"):
                await backend.run(jobs.add, b"x" * (2 << 20), b"")
            assert backend.stats()["cold_starts"] == 0  # refused before any process started
            with pytest.raises(RemoteError, match="StubbornError: payload: cannot be rebuilt"):
                await backend.run(jobs.fail_stubborn)
            with pytest.raises(TypeError, match="does not pickle"):
                await backend.run(jobs.unpicklable_result)
            with pytest.raises(CodecError) as info:
                await backend.run(jobs.fail, "why")
            assert "_testjobs.py" in str(info.value.__cause__)  # the worker's traceback
            assert backend.stats()["crashes"] == 0 and backend.stats()["jobs_failed"] == 3

    run(go())


@pytest.mark.integration
def test_a_job_whose_worker_is_killed_runs_again_and_answers_once(make_pool) -> None:
    ctrl_slab = make_pool().acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        async with process_backend(1) as backend:
            job = started(backend.run(jobs.hold, ctrl.ref, 0, block_attempts=1))
            await until(lambda: ctrl.started(0) == 1, "the job running")
            first_pid = ctrl.pid(0)
            os.kill(first_pid, signal.SIGKILL)
            pid, attempt = await job
            assert attempt == 2 and ctrl.started(0) == 2  # ran exactly twice
            assert pid != first_pid and gone(first_pid)
            stats = backend.stats()
            assert stats["crashes"] == 1 and stats["retries"] == 1 and stats["jobs_done"] == 1
            assert await backend.run(jobs.add, 1, 2) == 3
            assert backend.stats()["jobs_done"] == 2  # no stray second answer

    run(go())
    ctrl.close()


@pytest.mark.integration
def test_an_answer_sent_just_before_the_worker_died_is_delivered_once(make_pool) -> None:
    ctrl_slab = make_pool().acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        async with process_backend(1) as backend:
            job = started(backend.run(jobs.answer_then_die, ctrl.ref, 0))
            await until(lambda: ctrl.pid(0) != 0, "the job running")
            # Make the death the first thing the loop sees (the selector may report either
            # first): stop watching the pipe, and keep the loop busy until the worker is dead.
            (worker,) = backend._workers.values()
            asyncio.get_running_loop().remove_reader(worker.conn.fileno())
            ctrl.release(0)
            deadline = time.monotonic() + 20
            while not gone(ctrl.pid(0)):
                assert time.monotonic() < deadline, "the worker did not die"
            assert await job == ctrl.pid(0)
            await until(lambda: backend.stats()["workers"] == 0, "the dead worker reaped")
            stats = backend.stats()
            assert ctrl.started(0) == 1 and stats["retries"] == 0 and stats["jobs_done"] == 1
            assert stats["crashes"] == 1  # it died, but not with a job to redo

    run(go())
    ctrl.close()


@pytest.mark.integration
def test_a_job_that_kills_every_worker_gives_up_after_max_attempts() -> None:
    async def go() -> None:
        async with process_backend(2, max_attempts=3) as backend:
            with pytest.raises(WorkerCrashed, match=r"all 3 attempts \(exit codes \[-9, -9, -9\]"):
                await backend.run(jobs.kill_self)
            stats = backend.stats()
            assert stats["crashes"] == 3 and stats["retries"] == 2
            assert await backend.run(jobs.add, 2, 2) == 4  # still serving

    run(go())


@pytest.mark.integration
def test_close_fails_waiting_jobs_kills_stuck_ones_and_reaps_everything(make_pool) -> None:
    ctrl_slab = make_pool().acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        backend = ProcessBackend(1)
        stuck = started(backend.run(jobs.hold, ctrl.ref, 0))  # never released
        await until(lambda: ctrl.started(0) == 1, "the job running")
        queued = started(backend.run(jobs.add, 1, 2))
        await until(lambda: backend.stats()["queue_depth"] == 1, "a job queued")
        await backend.close(grace_s=0.2)
        with pytest.raises(BackendClosed, match="before the job ran"):
            await queued
        with pytest.raises(BackendClosed, match="closed while"):
            await stuck
        assert backend.stats()["workers"] == 0 and gone(ctrl.pid(0))
        with pytest.raises(BackendClosed):
            await backend.run(jobs.add, 1, 2)

    run(go())
    ctrl.close()


@needs_dev_shm
@pytest.mark.integration
def test_workers_leave_no_segment_behind_even_when_killed(make_pool) -> None:
    pool = make_pool()
    values = np.arange(4096, dtype=np.float32)
    ctrl_slab = pool.acquire(jobs.CONTROL_BYTES)
    assert ctrl_slab is not None
    ctrl = jobs.Control(ctrl_slab)

    async def go() -> None:
        async with process_backend(2, idle_s=0.2) as backend:
            for _ in range(4):
                src, dst = pool.acquire(values.nbytes), pool.acquire(values.nbytes)
                assert src is not None and dst is not None
                np.frombuffer(src.buf, np.float32, count=values.size)[:] = values
                await backend.run(jobs.scale_into, src.ref(), dst.out_ref(), 2.0)
                pool.release(src)
                pool.release(dst)
            job = started(backend.run(jobs.hold, ctrl.ref, 0))  # attaches the control slab
            await until(lambda: ctrl.started(0) == 1, "the job running")
            os.kill(ctrl.pid(0), signal.SIGKILL)
            await job
            await until(lambda: backend.stats()["workers"] == 0, "workers to stop")
        # Workers exiting (cleanly or killed) unlinked nothing: the pool still has its slabs.
        assert len(shm_names(pool.prefix)) == pool.stats()["slabs_in_use"] + \
            pool.stats()["slabs_idle"] > 0

    run(go())
    ctrl.close()
    pool.close()
    assert shm_names(pool.prefix) == set()


@pytest.mark.integration
@pytest.mark.slow
def test_the_spawn_start_method_runs_the_same_jobs(make_pool) -> None:
    pool = make_pool()
    src, dst = pool.acquire(8), pool.acquire(8)
    assert src is not None and dst is not None
    np.frombuffer(src.buf, np.float32, count=2)[:] = [1.5, -2.0]

    async def go() -> None:
        async with process_backend(1, start_method="spawn") as backend:
            assert await backend.run(jobs.scale_into, src.ref(), dst.out_ref(), 2.0) == -1.0
            assert backend.stats()["backend"] == "process/spawn"

    run(go())
    assert np.frombuffer(dst.buf, np.float32, count=2).tolist() == [3.0, -4.0]


@pytest.mark.integration
def test_serves_an_event_loop_running_in_another_thread() -> None:
    # The gRPC gateway runs its loop in a background thread (ServerThread).
    import threading

    answers: list[Any] = []

    def serve() -> None:
        answers.append(run(go()))

    async def go() -> tuple[int, int]:
        async with process_backend(1) as backend:
            return await backend.run(jobs.add, 20, 22), backend.stats()["jobs_done"]

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(TIMEOUT_S)
    assert answers == [(42, 1)]
