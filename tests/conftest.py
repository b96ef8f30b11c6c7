"""Shared fixtures: seeded generators, a tiny torch model, the digits task, one torch thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from murmura.tasks import Task, TaskConfig, load_task


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.Linear(3, 2))


@pytest.fixture(scope="session")
def digits() -> Task:
    """The bundled digits task, Dirichlet(0.5) label skew, loaded once."""
    return load_task(TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5))


@pytest.fixture
def one_torch_thread():
    """Pin torch to one thread, as murmura run's clients and the simulation do: many tiny
    kernels, where more threads mostly add OpenMP barriers on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wait_until(cond, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``cond()`` until it is true; fail naming ``what`` after ``timeout`` seconds. The one
    polling helper of the suite (import it: ``from tests.conftest import wait_until``)."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA and a server certificate for localhost/127.0.0.1: paths ``ca``, ``cert``, ``key``."""
    from murmura.protocols.tls import make_ca, make_server_cert

    root = tmp_path_factory.mktemp("pki")
    make_ca(root / "ca")
    make_server_cert(root / "ca", root / "server", ["localhost", "127.0.0.1"])
    return {"ca": root / "ca" / "ca.crt", "cert": root / "server" / "server.crt",
            "key": root / "server" / "server.key"}


@pytest.fixture
def serve_tiny() -> Iterator[Callable[..., Any]]:
    """serve_tiny(**flat_config) -> a loopback server of a 4-value model (2 clients, one
    version); every server started is stopped at teardown."""
    from murmura.protocols import ModelSpec, TensorSpec
    from murmura.server import AggregatorCore, ServerConfig, ServerThread

    running: list[ServerThread] = []

    def start(**cfg: object) -> ServerThread:
        core = AggregatorCore(ServerConfig.from_flat(min_clients=2, max_versions=1, **cfg),
                              ModelSpec((TensorSpec("w", (4,)),)), np.zeros(4, np.float32))
        srv = ServerThread(core, "127.0.0.1:0").start()
        running.append(srv)
        return srv

    yield start
    for srv in running:
        srv.stop(grace=None)
