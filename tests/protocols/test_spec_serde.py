"""ModelSpec conversions and the proto <-> Python pairs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from murmura.protocols import (
    Action,
    DeviceProfile,
    JoinResult,
    ModelSpec,
    PushResult,
    Task,
    TaskSettings,
    TensorSpec,
    UpdateHeader,
    serde,
)
from murmura.protocols import murmura_pb2 as pb


def test_flatten_and_load_round_trip_including_buffers(tiny_model) -> None:
    spec = ModelSpec.from_module(tiny_model)
    names = [t.name for t in spec.tensors]
    assert "1.running_mean" in names and "1.num_batches_tracked" not in names
    vec = spec.flatten(tiny_model)
    assert vec.dtype == np.float32 and vec.shape == (spec.size,)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 2))
    spec.load_into(other, vec)
    np.testing.assert_array_equal(spec.flatten(other), vec)
    views = spec.unflatten(vec)
    assert views["0.weight"].shape == (3, 4)


def test_fingerprint_tells_models_apart(tiny_model) -> None:
    a = ModelSpec.from_module(tiny_model)
    b = ModelSpec.from_module(torch.nn.Linear(4, 3))
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == ModelSpec.from_module(tiny_model).fingerprint()


def test_spec_refuses_bad_shapes_and_vectors(tiny_model) -> None:
    spec = ModelSpec.from_module(tiny_model)
    with pytest.raises(ValueError, match="flat vector"):
        spec.load_into(tiny_model, np.zeros(spec.size + 1, np.float32))
    with pytest.raises(ValueError, match="unique"):
        ModelSpec((TensorSpec("a", (1,)), TensorSpec("a", (2,))))
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("a", (1,), "int8")
    with pytest.raises(ValueError, match="does not match"):
        spec.flatten(torch.nn.Linear(2, 2))


def test_serde_pairs_round_trip(tiny_model) -> None:
    spec = ModelSpec.from_module(tiny_model)
    assert serde.spec_from_proto(serde.spec_to_proto(spec)) == spec
    prof = DeviceProfile("cuda", "H100", 80 << 30, 12.5, 16, {"k": "v"})
    assert serde.profile_from_proto(serde.profile_to_proto(prof)) == prof
    s = TaskSettings(trainer="zo", local_steps=5, codec="dense-f16", codec_options={"a": "1"},
                     seed=7, client_eval_every=4)
    assert serde.settings_from_proto(serde.settings_to_proto(s)) == s
    t = Task(Action.TRAIN, version=3, round=2, retry_after_s=0.5, seed=99)
    assert serde.task_from_proto(serde.task_to_proto(t)) == t
    h = UpdateHeader("s", "u", 3, 10, "dense-f32", 40, round=2, metrics={"loss": 0.5},
                     spec_fingerprint="abc")
    assert serde.update_header_from_proto(serde.update_header_to_proto(h)) == h
    r = PushResult(duplicate=True, version=4, staleness=1)
    assert serde.push_result_from_proto(serde.push_result_to_proto(r)) == r
    j = JoinResult("sess", s, "async", 1234)
    assert serde.join_result_from_proto(serde.join_result_to_proto(j, spec)) == (j, spec)


def test_chunk_streams_carry_the_payload_exactly() -> None:
    payload = bytes(range(256)) * 41  # 10,496 bytes
    chunks = list(serde.iter_update_chunks(
        UpdateHeader("s", "u", 0, 1, "dense-f32", len(payload)), payload, chunk_bytes=1000))
    assert chunks[0].WhichOneof("kind") == "header"
    assert len(chunks) == 1 + 11
    assert b"".join(c.data for c in chunks[1:]) == payload
    spec = ModelSpec((TensorSpec("w", (2,)),))
    model = list(serde.iter_model_chunks(5, spec, "dense-f32", payload, chunk_bytes=4096))
    assert model[0].header.version == 5 and model[0].header.payload_bytes == len(payload)
    assert b"".join(c.data for c in model[1:]) == payload
    assert isinstance(model[1], pb.ModelChunk)


def test_task_settings_validate() -> None:
    with pytest.raises(ValueError, match="trainer"):
        TaskSettings(trainer="adam")
    with pytest.raises(ValueError, match="lr"):
        TaskSettings(lr=0)
    with pytest.raises(ValueError, match="local_epochs or local_steps"):
        TaskSettings(local_epochs=0, local_steps=0)
    with pytest.raises(ValueError, match="client_eval_every must be >= 0"):
        TaskSettings(client_eval_every=-1)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 70_000, 1 << 20])
def test_data_chunk_framing_is_byte_identical_to_the_proto(n) -> None:
    data = (bytes(range(256)) * (n // 256 + 1))[:n]
    raw = serde.serialize_update_item(memoryview(data))
    assert raw == pb.UpdateChunk(data=data).SerializeToString()
    assert raw == serde.serialize_model_item(data) == pb.ModelChunk(data=data).SerializeToString()
    assert serde.data_chunk_wire_bytes(n) == len(raw)
    view = serde.deserialize_update_item(raw)
    assert isinstance(view, memoryview) and bytes(view) == data


def test_non_data_chunks_are_parsed_as_messages() -> None:
    header = pb.UpdateChunk(header=pb.UpdateHeader(session="s", update_id="u"))
    parsed = serde.deserialize_update_item(header.SerializeToString())
    assert isinstance(parsed, pb.UpdateChunk) and parsed.header.update_id == "u"
    # a data chunk followed by another field is not a bare frame: parsed, not sliced
    odd = pb.UpdateChunk(data=b"abc").SerializeToString() + b"\x0a\x00"
    assert isinstance(serde.deserialize_update_item(odd), pb.UpdateChunk)
