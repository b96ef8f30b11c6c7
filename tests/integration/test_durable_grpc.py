"""Durable state over real gRPC: a server stopped and started again on the same output
directory keeps the client's session, answers a retried push as a duplicate, and continues
its counters and versions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from murmura.client import GrpcTransport
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import ServerConfig
from murmura.server.app import assemble_core

SPEC = ModelSpec((TensorSpec("w", (64,)),))


def config(workers: int) -> ServerConfig:
    # Plain ids: tests/server/test_durable.py restores a proven key across a restart.
    return ServerConfig.from_flat(mode="async", buffer_size=2, max_versions=10, workers=workers,
                                  require_identity=False)


def header(session: str, uid: str, payload: bytes, base: int = 0) -> UpdateHeader:
    return UpdateHeader(session=session, update_id=uid, base_version=base, num_examples=5,
                        codec="dense-f32", payload_bytes=len(payload),
                        spec_fingerprint=SPEC.fingerprint())


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_restarted_server_keeps_sessions_counted_ids_and_counters(tmp_path, serve,
                                                                  workers) -> None:
    """workers=1: payloads are spooled from shared-memory slabs while a worker decodes."""
    payload = np.full(64, 0.5, "<f4").tobytes()
    core = assemble_core(config(workers), SPEC, np.zeros(64, np.float32), out_dir=tmp_path,
                         durable=True)
    srv = serve(core)
    t = GrpcTransport(srv.address)
    session = t.join("a", DeviceProfile())[0].session
    for uid in ("u1", "u2", "u3"):
        assert not t.push(header(session, uid, payload), payload).duplicate
    t.close()
    srv.stop()

    again = assemble_core(config(workers), SPEC, np.zeros(64, np.float32), out_dir=tmp_path,
                          durable=True)
    srv2 = serve(again)
    t = GrpcTransport(srv2.address)
    try:
        # the old session works, and the retried push is recognised
        assert t.push(header(session, "u3", payload), payload).duplicate
        assert srv2.call(lambda: again.policy.buffered()) == 1  # u3 was replayed
        reply = t.push(header(session, "u4", payload, base=1), payload)
        assert not reply.duplicate and reply.version == 2
    finally:
        t.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    assert [r["updates"] for r in rows] == [2, 4]
    assert rows[1]["bytes_up"] > rows[0]["bytes_up"] > 0
