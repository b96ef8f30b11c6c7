"""A push's payload lands in its buffer as the chunks arrive, whatever their sizes: over real
gRPC on loopback, a durable server spools exactly the bytes that were sent, and folds them."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from murmura.client import GrpcTransport
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.server import ServerConfig
from murmura.server.app import assemble_core
from murmura.server.store import SqliteState

N = 300_001  # 1,200,004 bytes: a pooled receive buffer, a direct spool write, a partial block
SPEC = ModelSpec((TensorSpec("w", (N,)),))
#: chunk sizes in the order they are sent; the rest of the payload goes in one last chunk
CUTS = [1, 3, 4093, 65_537, 7, 1 << 20, 2]


def push_in_chunks(address: str, header: UpdateHeader, payload: bytes) -> pb.PushReply:
    """Push ``payload`` framed in the odd chunk sizes of :data:`CUTS`."""
    items: list[pb.UpdateChunk | memoryview] = [
        pb.UpdateChunk(header=serde.update_header_to_proto(header))]
    view, at = memoryview(payload), 0
    for size in CUTS:
        items.append(view[at:at + size])
        at += size
    items.append(view[at:])
    assert at < len(payload)
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary("/murmura.v1.Aggregator/Push",
                                    request_serializer=serde.serialize_update_item,
                                    response_deserializer=pb.PushReply.FromString)
        return push(iter(items), timeout=30)


@pytest.mark.integration
@pytest.mark.parametrize(("workers", "receivers"),
                         [(0, 0), pytest.param(1, 0, marks=pytest.mark.slow), (1, 1)])
def test_a_push_in_odd_sized_chunks_lands_byte_identical(tmp_path, serve, workers,
                                                         receivers) -> None:
    """workers=1: the chunks land in a shared-memory slab that a worker process decodes;
    receivers=1: a receiver process writes them into that slab (server/receivers.py)."""
    config = ServerConfig.from_flat(mode="async", buffer_size=2, max_versions=10,
                                    workers=workers, require_identity=False, optimizer="fedavg",
                                    receivers=receivers)
    initial = np.zeros(N, np.float32)
    core = assemble_core(config, SPEC, initial, out_dir=tmp_path, durable=True)
    srv = serve(core)
    t = GrpcTransport(srv.address)
    session = t.join("a", DeviceProfile())[0].session
    rng = np.random.default_rng(5)
    updates = [rng.normal(size=N).astype("<f4") for _ in range(3)]
    payloads = [u.tobytes() for u in updates]
    headers = [UpdateHeader(session=session, update_id=f"u{i}", base_version=0, num_examples=1,
                            codec="dense-f32", payload_bytes=len(p),
                            spec_fingerprint=SPEC.fingerprint())
               for i, p in enumerate(payloads)]
    t.close()

    address = srv.address if not receivers else \
        f"127.0.0.1:{srv.call(lambda: srv.server.push_port)}"
    replies = [push_in_chunks(address, h, p) for h, p in zip(headers, payloads, strict=True)]
    if receivers:
        assert srv.call(srv.server.receivers.stats)["receiver_pushes"] == 3

    assert [r.duplicate for r in replies] == [False] * 3
    # the first two made version 1: their mean, folded from the bytes that landed
    version, model = srv.call(lambda: core.model(session))
    assert version == 1
    np.testing.assert_allclose(model, (updates[0] + updates[1]) / 2, rtol=1e-6, atol=1e-6)
    srv.stop()
    state = SqliteState(tmp_path)  # the third is pending: its spooled bytes are the sent ones
    try:
        (pending,) = state.load().pending
        assert pending.header["update_id"] == "u2"
        assert state.read_payload(pending.ref) == payloads[2]
    finally:
        state.close()
