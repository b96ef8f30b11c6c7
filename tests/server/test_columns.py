"""A rule's column work in real worker processes (server/columns.py): the threads' bits, a
worker killed mid-job, a failing job or a closed backend lose nothing, arrays the runner
cannot share stay on threads, and no segment is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from murmura.aggregation import CoordinateMedian, MultiKrum, RobustDefault, TrimmedMean
from murmura.aggregation.columns import BLOCK, UNIT
from murmura.server import _testjobs as jobs
from murmura.server.columns import ProcessColumns
from murmura.server.process_backend import ProcessBackend
from tests.server.conftest import needs_dev_shm, shm_names

pytestmark = [pytest.mark.integration, needs_dev_shm]

TIMEOUT_S = 120.0


@asynccontextmanager
async def columns(workers: int = 2, **kwargs: Any) -> AsyncIterator[ProcessColumns]:
    backend = ProcessBackend(workers, idle_s=30.0, preload=("murmura.server.columns",))
    runner = ProcessColumns(backend, workers=workers, **kwargs)
    runner.bind(asyncio.get_running_loop())
    try:
        yield runner
    finally:
        runner.close()
        await backend.close(grace_s=2.0)
    assert not shm_names("murmura_rows"), "a segment was left in /dev/shm"


def in_thread(fn: Any, *args: Any) -> Any:
    """The publisher's side: column runs block, so they run off the event loop."""
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def versions(rule: Any, count: int, p: int) -> list[np.ndarray]:
    out = []
    for version in range(count):
        rng = np.random.default_rng([version, 11])
        base = rng.standard_normal(p).astype(np.float32)
        for i in range(8):
            u = ((base + rng.standard_normal(p).astype(np.float32)) * 0.01).astype(np.float32)
            rule.add(u, 10.0 + i, factor=1.0 - 0.05 * (i % 3),
                     client_id=f"c{(i + 3 * version) % 12}")
        out.append(rule.result())
        rule.reset()
    return out


def test_default_in_the_workers_gives_the_threads_bits() -> None:
    p = 2 * UNIT + 5 * BLOCK + 3  # reductions over three units, huber over many ranges

    async def go() -> None:
        async with columns(2, min_columns=BLOCK, min_range=BLOCK) as runner:
            threads = await in_thread(versions, RobustDefault(p), 4, p)
            rule = RobustDefault(p)
            rule.use_columns(runner)
            workers = await in_thread(versions, rule, 4, p)
            for v, (a, b) in enumerate(zip(threads, workers, strict=True)):
                assert np.array_equal(a, b), f"version {v} differs"
            stats = runner.stats()
            assert stats["column_jobs"] >= 4 * 5 and stats["column_fallbacks"] == 0
            assert len(rule.last_history) > 0  # history rows were read by the jobs
            # called on the loop itself it cannot wait for jobs: threads, same bits
            before = runner.local_runs
            rule.add(np.ones(p, np.float32), 1.0, client_id="z")
            rule.result()
            assert runner.local_runs > before
            rule.reset()

    run(go())


def test_median_trimmed_mean_and_multi_krum_in_the_workers_give_the_threads_bits() -> None:
    p = UNIT + 3 * BLOCK + 1

    async def go() -> None:
        async with columns(2, min_columns=BLOCK, min_range=BLOCK) as runner:
            for make in (CoordinateMedian, lambda size: TrimmedMean(size, trim=0.25),
                         lambda size: MultiKrum(size, f=2)):
                threads, workers = make(p), make(p)
                workers.use_columns(runner)
                jobs_before = runner.jobs
                a = await in_thread(versions, threads, 2, p)
                b = await in_thread(versions, workers, 2, p)
                assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
                assert runner.jobs > jobs_before

    run(go())


def test_a_worker_killed_mid_job_or_a_failing_job_loses_nothing(tmp_path: Path) -> None:
    p = 6 * BLOCK + 7
    src = np.arange(p, dtype=np.float32)
    die, fail = tmp_path / "die", tmp_path / "fail"

    async def go() -> None:
        async with columns(2, min_columns=BLOCK, min_range=BLOCK) as runner:
            shared = runner.allocate((p,), np.float32)
            shared[:] = src
            out = np.zeros(p, np.float32)
            die.touch()
            await in_thread(runner.run, jobs.copy_or_die, {"src": shared}, (str(die), str(fail)),
                            out, p)
            assert not die.exists(), "no job died"
            assert np.array_equal(out, src * 2)
            assert runner.backend.stats()["crashes"] == 1 and runner.fallbacks == 0
            def failing() -> None:
                fail.touch()
                runner.run(jobs.copy_or_die, {"src": shared}, (str(die), str(fail)), out, p)

            # a kernel that fails in the workers and in the fallback raises: nothing hidden
            with pytest.raises(RuntimeError, match="a kernel that fails"):
                await in_thread(failing)
            assert runner.fallbacks == 1  # the first redo raised
            fail.unlink()
            await runner.backend.close(grace_s=2.0)  # a closed backend: all on the publisher
            out[:] = 0
            await in_thread(runner.run, jobs.copy_or_die, {"src": shared}, (str(die), str(fail)),
                            out, p)
            assert np.array_equal(out, src * 2)
            assert runner.fallbacks == 1 + len(runner.ranges(p))
            runner.release(shared)

    run(go())


def test_arrays_it_cannot_share_stay_on_threads() -> None:
    p = 4 * BLOCK

    async def go() -> None:
        async with columns(2, min_columns=BLOCK, min_range=BLOCK) as runner:
            out = np.zeros(p, np.float32)
            src = np.arange(p, dtype=np.float32)  # an ordinary array: no segment holds it
            await in_thread(runner.run, jobs.copy_or_die, {"src": src}, ("/nonexistent",
                            "/nonexistent"), out, p)
            assert np.array_equal(out, src * 2)
            assert runner.jobs == 0 and runner.local_runs == 1
            small = runner.allocate((16,), np.float32)  # under min_columns: not shared
            assert runner._ref(small) is None
            assert runner.ranges(10 * BLOCK + 1) == [(a, min(a + 3 * BLOCK, 10 * BLOCK + 1))
                                                     for a in range(0, 10 * BLOCK + 1,
                                                                    3 * BLOCK)]

    run(go())


def test_no_room_in_shared_memory_keeps_the_arrays_private(tmp_path: Path) -> None:
    async def go() -> None:
        async with columns(1, min_columns=BLOCK, shm_dir=str(tmp_path / "missing")) as runner:
            array = runner.allocate((2, 4 * BLOCK), np.float32)
            assert runner._ref(array) is None  # a plain array: the work stays on threads

    run(go())
