"""`default`'s per-coordinate work in the aggregation workers (server/columns.py) over real
gRPC on loopback: the model is the in-process server's bit for bit, sync and async, and the
metrics row says the work ran as column jobs."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from murmura.client import GrpcTransport
from murmura.protocols import (
    DeviceProfile,
    ModelSpec,
    TaskSettings,
    TensorSpec,
    UpdateHeader,
    create_codec,
)
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.columns import MIN_COLUMNS
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

SIZE = MIN_COLUMNS + 4_321  # just large enough to be sent to the workers
CLIENTS = 6


def spec() -> ModelSpec:
    return ModelSpec((TensorSpec("w", (SIZE,)),))


def update_for(client: int, version: int) -> np.ndarray:
    rng = np.random.default_rng([client, version, 5])
    shared = np.random.default_rng([version, 1]).standard_normal(SIZE)
    return ((shared + rng.standard_normal(SIZE)) * 0.01).astype(np.float32)


def run(serve, *, workers: int, mode: str, versions: int = 3) -> tuple[np.ndarray, dict]:
    extra = {"buffer_size": CLIENTS} if mode == "async" else {}
    cfg = ServerConfig.from_flat(min_clients=CLIENTS, max_versions=versions, workers=workers,
                                 max_workers=max(workers, 1), mode=mode, defense="default",
                                 require_identity=False,
                                 train=TaskSettings(codec="int8"), **extra)
    srv = serve(AggregatorCore(cfg, spec(), np.zeros(SIZE, np.float32)))
    t = GrpcTransport(srv.address, timeout_s=60)
    sessions = [t.join(f"client-{i}", DeviceProfile())[0].session for i in range(CLIENTS)]
    codec = create_codec("int8", {})
    for _ in range(versions):
        tasks = [t.task(s, 5.0) for s in sessions]
        version = tasks[0].version

        def push(i: int, version: int, round_: int) -> None:
            payload = codec.encoder(SIZE, seed=i).encode(update_for(i, version))
            t.push(UpdateHeader(session=sessions[i], update_id=uuid.uuid4().hex[:12],
                                base_version=version, round=round_, num_examples=10 + i,
                                codec="int8", payload_bytes=len(payload),
                                spec_fingerprint=spec().fingerprint()), payload)
        if mode == "async":  # one at a time: the buffer's order is the arrival order
            for i in range(CLIENTS):
                push(i, version, tasks[i].round)
        else:
            threads = [threading.Thread(target=push, args=(i, version, tasks[i].round))
                       for i in reversed(range(CLIENTS))]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        wait_until(lambda v=version: t.pull(sessions[0])[0] == v + 1, what="the next version")
    params = t.pull(sessions[0])[1]
    row = srv.call(lambda: dict(srv.core.last_metrics))
    t.close()
    return params, row


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_in_the_workers_is_the_in_process_model_bit_for_bit(serve, mode: str) -> None:
    flat, row = run(serve, workers=0, mode=mode)
    assert "column_jobs" not in row
    model, row = run(serve, workers=2, mode=mode)
    assert row["column_jobs"] > 0 and row["column_fallbacks"] == 0
    assert np.array_equal(model, flat)
    assert np.abs(flat).sum() > 0
