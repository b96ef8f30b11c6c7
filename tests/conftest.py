"""Shared fixtures: seeded generators, a tiny torch model, the digits task, one torch thread."""

from __future__ import annotations

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
