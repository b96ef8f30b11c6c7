"""RayBackend (server/raybackend.py): the backend contract on a real local Ray (one CPU), the
slab-in/slab-out convention, back-pressure, and the message when Ray is missing."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from murmura.server import _testjobs as jobs
from murmura.server.raybackend import RAY_MISSING
from murmura.server.workers import BackendClosed, QueueFull, WorkerCrashed
from tests.server.test_workers import BackendContract, run

pytestmark = pytest.mark.filterwarnings("ignore:Tip.*:FutureWarning")  # Ray's, at init


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch) -> None:
    from murmura.server.raybackend import RayBackend

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError) as info:
        RayBackend()
    assert str(info.value) == 'Ray is not installed: pip install "murmura[ray]"' == RAY_MISSING


@pytest.fixture(scope="module")
def ray_backend() -> Iterator[Any]:
    """One local Ray for the module (starting it takes seconds), shut down at teardown."""
    pytest.importorskip("ray", reason="Ray is an extra: pip install -e \".[ray]\" (in dev)")
    from murmura.server.raybackend import RayBackend

    backend = RayBackend(num_cpus=1, object_store_memory=100 << 20,
                         log_to_driver=False)
    try:
        yield backend
    finally:
        run(backend.close())
        import ray

        assert not ray.is_initialized()


@pytest.mark.integration
@pytest.mark.slow
class TestRayBackendContract(BackendContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _backend(self, ray_backend: Any) -> None:
        self.backend = ray_backend

    def open(self) -> Any:
        @asynccontextmanager
        async def shared() -> AsyncIterator[Any]:
            yield self.backend  # the module's Ray stays up between tests

        return shared()

    def test_a_large_output_comes_back_into_the_slab(self, make_pool) -> None:
        pool = make_pool()
        values = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
        src, dst = pool.acquire(values.nbytes), pool.acquire(values.nbytes)
        assert src is not None and dst is not None
        np.frombuffer(src.buf, np.float32, count=values.size)[:] = values

        async def go() -> float:
            return await self.backend.run(jobs.scale_into, src.ref(), out=dst.out_ref(),
                                          factor=-1.0)

        total = run(go())
        out = np.frombuffer(dst.buf, np.float32, count=values.size)
        assert np.array_equal(out, -values)
        assert total == pytest.approx(-float(values.sum(dtype=np.float64)), rel=1e-4)
        del out

    def test_a_function_that_ignores_the_output_convention_is_named(self, make_pool) -> None:
        dst = make_pool().acquire(8)
        assert dst is not None

        async def go() -> None:
            with pytest.raises(TypeError, match="must return write_out"):
                await self.backend.run(jobs.ignores_out, dst.out_ref())

        run(go())

    def test_in_flight_cap_and_a_shared_session(self) -> None:
        from murmura.server.raybackend import RayBackend

        capped = RayBackend(max_in_flight=1)  # Ray is up: this one shares it, owns nothing

        async def go() -> list[Any]:
            return await asyncio.gather(capped.run(jobs.add, 1, 1), capped.run(jobs.add, 2, 2),
                                        return_exceptions=True)

        first, second = run(go())
        assert first == 2 and isinstance(second, QueueFull)
        assert capped.stats()["rejected"] == 1
        run(capped.close())
        with pytest.raises(BackendClosed):
            run(capped.run(jobs.add, 1, 1))
        assert run(self.backend.run(jobs.add, 3, 4)) == 7  # the shared session is still up

    def test_a_task_whose_worker_dies_is_worker_crashed(self) -> None:
        from murmura.server.raybackend import RayBackend

        once = RayBackend(max_attempts=1)  # shares the session; Ray does not retry its tasks

        with pytest.raises(WorkerCrashed, match="kill_self: the Ray worker running it died"):
            run(once.run(jobs.kill_self))
        assert once.stats()["crashes"] == 1
        run(once.close())
        assert run(self.backend.run(jobs.add, 1, 2)) == 3  # Ray replaced the worker
