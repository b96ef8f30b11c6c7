"""The simulated byte counts equal what the gRPC transport counts (sum of chunk ByteSize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from murmura.protocols import ModelSpec, UpdateHeader, serde
from murmura.simulation import ModelWire, update_header_bytes, update_wire_bytes
from murmura.simulation.wire import varint_size


def _grpc_push_bytes(header: UpdateHeader, chunk_bytes: int) -> int:
    payload = bytes(header.payload_bytes)
    return sum(c.ByteSize() for c in serde.iter_update_chunks(header, payload, chunk_bytes))


@pytest.mark.parametrize("value", [0, 1, 127, 128, 16383, 16384, 2**31, 2**63 - 1, -1, -(2**40)])
def test_varint_size_matches_protobuf(value: int) -> None:
    from murmura.protocols import murmura_pb2 as pb

    msg = pb.UpdateHeader(base_version=value)
    assert msg.ByteSize() == (1 + varint_size(value) if value else 0)


def test_update_wire_bytes_match_the_grpc_chunk_stream(rng: np.random.Generator) -> None:
    for _ in range(300):
        metrics = {f"m{'é' * int(rng.integers(0, 3))}{k}": float(rng.normal()) * (k % 2)
                   for k in range(int(rng.integers(0, 4)))}
        header = UpdateHeader(
            session="s" * int(rng.integers(0, 40)), update_id="u" * int(rng.integers(0, 40)),
            base_version=int(rng.choice([0, 1, 300, 2**40, -3])),
            round=int(rng.choice([0, 5, 70000])), num_examples=int(rng.integers(0, 10**6)),
            codec=str(rng.choice(["", "dense-f32", "topk"])),
            payload_bytes=int(rng.choice([0, 1, 100, 4096, 10**5 + 7])), metrics=metrics,
            spec_fingerprint=str(rng.choice(["", "0123456789abcdef"])))
        chunk = int(rng.choice([1, 7, 1024, serde.CHUNK_BYTES]))
        assert update_header_bytes(header) == serde.update_header_to_proto(header).ByteSize()
        assert update_wire_bytes(header, chunk) == _grpc_push_bytes(header, chunk)


def test_model_wire_bytes_match_the_grpc_chunk_stream(tiny_model: torch.nn.Module) -> None:
    spec = ModelSpec.from_module(tiny_model)
    big = ModelSpec.from_module(torch.nn.Linear(700, 800))  # > 2 chunks of 1 MiB
    for s, chunk in [(spec, serde.CHUNK_BYTES), (spec, 8), (big, serde.CHUNK_BYTES)]:
        wire = ModelWire(s, chunk_bytes=chunk)
        payload = bytes(s.nbytes)
        for version in (0, 1, 129, 2**33):
            want = sum(c.ByteSize() for c in serde.iter_model_chunks(version, s, "dense-f32",
                                                                   payload, chunk))
            assert wire(version) == want
