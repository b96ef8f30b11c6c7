"""Fixtures for the simulation tests: every test runs with one torch thread."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """The shared ``one_torch_thread`` fixture, for every simulation test."""
    yield
