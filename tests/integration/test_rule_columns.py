"""`default`'s per-coordinate work in the aggregation workers (server/columns.py) over real
gRPC on loopback: the model is the in-process server's bit for bit, sync and async, and the
metrics row says the work ran as column jobs."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.server.columns import MIN_COLUMNS
from tests.integration.test_worker_folds import run

pytestmark = pytest.mark.integration

SIZE = MIN_COLUMNS + 4_321  # just large enough to be sent to the workers


def update_for(client: int, version: int, size: int) -> np.ndarray:
    """A direction all clients share this version plus each client's own: what `default`
    expects of honest updates (random ones would be screened out as inconsistent)."""
    shared = np.random.default_rng([version, 1]).standard_normal(size)
    return ((shared + np.random.default_rng([client, version, 5]).standard_normal(size))
            * 0.01).astype(np.float32)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_in_the_workers_is_the_in_process_model_bit_for_bit(serve, mode: str) -> None:
    kw = dict(mode=mode, codec="int8", defense="default", clients=6, versions=3, size=SIZE,
              make_update=update_for, in_order=mode == "async", folds="auto")
    flat, row = run(serve, workers=0, **kw)
    assert "column_jobs" not in row
    model, row = run(serve, workers=2, **kw)
    assert row["column_jobs"] > 0 and row["column_fallbacks"] == 0
    assert np.array_equal(model, flat)
    assert np.abs(flat).sum() > 0
    if mode == "sync":  # the same pushes through 2 receiver processes (server/receivers.py)
        received, row = run(serve, workers=2, receivers=2, **kw)
        assert row["receiver_pushes"] == 18 and np.array_equal(received, flat)
