"""Fixtures for the server tests: slab pools that must leave nothing in /dev/shm."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from murmura.server import slabs
from murmura.server.slabs import SlabPool

SHM = Path("/dev/shm")
needs_dev_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")


def shm_names(prefix: str) -> set[str]:
    """Segments in /dev/shm made by the pool with this prefix."""
    if not SHM.is_dir():
        return set()
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix + "_")}


@pytest.fixture
def make_pool() -> Iterator[Callable[..., SlabPool]]:
    """make_pool(max_bytes, **kw) -> a pool with a unique prefix; at teardown every pool is
    closed, and none may leave a segment behind."""
    pools: list[SlabPool] = []

    def make(max_bytes: int = 64 << 20, **kwargs: object) -> SlabPool:
        pool = SlabPool(max_bytes, prefix=f"mt{uuid.uuid4().hex[:8]}", **kwargs)  # type: ignore
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
    slabs.detach_all()
    leaked = sorted(name for pool in pools for name in shm_names(pool.prefix))
    assert not leaked, f"segments left in /dev/shm: {leaked}"
