"""Fixtures shared by the loopback integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from murmura.server import AggregatorCore, ServerThread


@pytest.fixture
def serve() -> Iterator[Callable[[AggregatorCore], ServerThread]]:
    """serve(core) -> a running loopback server; every server is stopped at teardown."""
    running: list[ServerThread] = []

    def start(core: AggregatorCore) -> ServerThread:
        srv = ServerThread(core, "127.0.0.1:0").start()
        running.append(srv)
        assert srv.port != 0
        return srv

    yield start
    for srv in running:
        srv.stop(grace=None)
