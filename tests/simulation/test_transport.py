"""The in-memory transport keeps the gRPC transport's contract: statuses, bytes, copies."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.client import RemoteError
from murmura.protocols import DeviceProfile, TaskSettings, UpdateHeader
from murmura.server import ServerConfig, build_core
from murmura.simulation import LocalAggregator, update_wire_bytes
from murmura.tasks import TaskConfig


@pytest.fixture
def hub() -> LocalAggregator:
    core = build_core(ServerConfig.from_flat(min_clients=1, max_versions=2, require_identity=False,
                                             train=TaskSettings(local_epochs=1)),
                      TaskConfig(task="digits", model="logreg"), out_dir=None, evaluate=False)
    return LocalAggregator(core)


def test_refusals_arrive_as_remote_errors_with_the_grpc_status(hub: LocalAggregator) -> None:
    t = hub.transport()
    with pytest.raises(RemoteError) as bad_id:
        t.join("", DeviceProfile())
    assert bad_id.value.status == "INVALID_ARGUMENT" and not bad_id.value.retryable
    with pytest.raises(RemoteError) as no_session:
        t.task("nope", 0.0)
    assert no_session.value.status == "UNAUTHENTICATED"


def test_a_round_trip_pulls_a_copy_and_counts_the_grpc_bytes(hub: LocalAggregator) -> None:
    t = hub.transport()
    result, spec = t.join("client-000", DeviceProfile())
    task = t.task(result.session, 1.0)
    version, params = t.pull(result.session)
    params[:] = 0.0  # a writable copy: the global model is untouched
    assert np.abs(hub.core.params).sum() > 0
    payload = np.ones(spec.size, dtype=np.float32).tobytes()
    header = UpdateHeader(session=result.session, update_id="u" * 32, base_version=version,
                          round=task.round, num_examples=10, codec="dense-f32",
                          payload_bytes=len(payload), spec_fingerprint=spec.fingerprint())
    reply = t.push(header, payload)
    assert reply.version == 1 and not reply.duplicate
    assert t.bytes_up == hub.core.traffic.bytes_up == update_wire_bytes(header)
    assert t.push(header, payload).duplicate  # a retried push counts once
    t.leave(result.session)
    with pytest.raises(RemoteError, match="has ended"):
        t.pull(result.session)
