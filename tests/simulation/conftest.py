"""Fixtures for the simulation tests: the bundled digits task, loaded once."""

from __future__ import annotations

import pytest
import torch

from murmura.tasks import Task, TaskConfig, load_task


@pytest.fixture(scope="session")
def digits() -> Task:
    return load_task(TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Pin torch to one thread, as the simulation and murmura run's clients do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
