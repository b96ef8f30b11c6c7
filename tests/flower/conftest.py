"""Flower is an extra (``flower``, in ``dev``): without it every test module here is reported
as skipped, with the reason, instead of failing to import ``flwr``.

A ``pytest.importorskip`` at this conftest's top would do the same for ``pytest`` run from the
root, but pytest cannot skip an initial conftest: ``pytest tests/flower`` would end in an
error. So the hook below stands in for each test module's collector.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NoReturn

import pytest

FLOWER = importlib.util.find_spec("flwr") is not None
REASON = 'Flower is an extra: pip install -e ".[flower]" (in dev)'


class _NeedsFlower(pytest.File):
    """A test module that cannot be imported without Flower: collecting it skips it."""

    def collect(self) -> NoReturn:
        pytest.skip(REASON)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector
                                ) -> pytest.Collector | None:
    if FLOWER:
        return None  # pytest's own module collector
    return _NeedsFlower.from_parent(parent, path=module_path)
