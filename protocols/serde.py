"""Conversions between the plain types and the generated protobuf messages, in pairs."""

from __future__ import annotations

from collections.abc import Iterator

from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.messages import (
    Action,
    DeviceProfile,
    JoinResult,
    PushResult,
    Task,
    TaskSettings,
    UpdateHeader,
)
from murmura.protocols.spec import ModelSpec, TensorSpec

#: Payload bytes per stream chunk: well under gRPC's 4 MiB default message limit.
CHUNK_BYTES = 1 << 20


def spec_to_proto(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(
        tensors=[pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=t.dtype)
                 for t in spec.tensors]
    )


def spec_from_proto(msg: pb.ModelSpec) -> ModelSpec:
    return ModelSpec(tuple(TensorSpec(t.name, tuple(t.shape), t.dtype) for t in msg.tensors))


def profile_to_proto(p: DeviceProfile) -> pb.DeviceProfile:
    return pb.DeviceProfile(device=p.device, device_name=p.device_name,
                            memory_bytes=p.memory_bytes, steps_per_s=p.steps_per_s,
                            cpu_count=p.cpu_count, extra=dict(p.extra))


def profile_from_proto(m: pb.DeviceProfile) -> DeviceProfile:
    return DeviceProfile(device=m.device or "cpu", device_name=m.device_name,
                         memory_bytes=m.memory_bytes, steps_per_s=m.steps_per_s,
                         cpu_count=m.cpu_count, extra=dict(m.extra))


def settings_to_proto(s: TaskSettings) -> pb.TaskSettings:
    return pb.TaskSettings(trainer=s.trainer, local_epochs=s.local_epochs,
                           local_steps=s.local_steps, batch_size=s.batch_size, lr=s.lr,
                           momentum=s.momentum, codec=s.codec,
                           codec_options=dict(s.codec_options), seed=s.seed,
                           zo_eps=s.zo_eps)


def settings_from_proto(m: pb.TaskSettings) -> TaskSettings:
    return TaskSettings(trainer=m.trainer, local_epochs=m.local_epochs,
                        local_steps=m.local_steps, batch_size=m.batch_size, lr=m.lr,
                        momentum=m.momentum, codec=m.codec,
                        codec_options=dict(m.codec_options), seed=m.seed,
                        zo_eps=m.zo_eps or 1e-3)


def task_to_proto(t: Task) -> pb.TaskReply:
    return pb.TaskReply(action=int(t.action), version=t.version, round=t.round,
                        retry_after_s=t.retry_after_s, seed=t.seed)


def task_from_proto(m: pb.TaskReply) -> Task:
    return Task(action=Action(m.action), version=m.version, round=m.round,
                retry_after_s=m.retry_after_s, seed=m.seed)


def update_header_to_proto(h: UpdateHeader) -> pb.UpdateHeader:
    return pb.UpdateHeader(session=h.session, update_id=h.update_id,
                           base_version=h.base_version, round=h.round,
                           num_examples=h.num_examples, codec=h.codec,
                           payload_bytes=h.payload_bytes, metrics=dict(h.metrics),
                           spec_fingerprint=h.spec_fingerprint)


def update_header_from_proto(m: pb.UpdateHeader) -> UpdateHeader:
    return UpdateHeader(session=m.session, update_id=m.update_id,
                        base_version=m.base_version, round=m.round,
                        num_examples=m.num_examples, codec=m.codec,
                        payload_bytes=m.payload_bytes, metrics=dict(m.metrics),
                        spec_fingerprint=m.spec_fingerprint)


def join_result_to_proto(r: JoinResult, spec: ModelSpec) -> pb.JoinReply:
    return pb.JoinReply(session=r.session, settings=settings_to_proto(r.settings),
                        spec=spec_to_proto(spec), mode=r.mode,
                        max_payload_bytes=r.max_payload_bytes)


def join_result_from_proto(m: pb.JoinReply) -> tuple[JoinResult, ModelSpec]:
    result = JoinResult(session=m.session, settings=settings_from_proto(m.settings),
                        mode=m.mode, max_payload_bytes=m.max_payload_bytes)
    return result, spec_from_proto(m.spec)


def push_result_to_proto(r: PushResult) -> pb.PushReply:
    return pb.PushReply(duplicate=r.duplicate, version=r.version, staleness=r.staleness)


def push_result_from_proto(m: pb.PushReply) -> PushResult:
    return PushResult(duplicate=m.duplicate, version=m.version, staleness=m.staleness)


def iter_update_chunks(header: UpdateHeader, payload: bytes | memoryview,
                       chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.UpdateChunk]:
    """The chunk stream of one push: the header, then the payload in slices."""
    yield pb.UpdateChunk(header=update_header_to_proto(header))
    view = memoryview(payload)
    for start in range(0, len(view), chunk_bytes):
        yield pb.UpdateChunk(data=bytes(view[start : start + chunk_bytes]))


def iter_model_chunks(version: int, spec: ModelSpec, codec: str, payload: bytes | memoryview,
                      chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.ModelChunk]:
    """The chunk stream of one pull: the header, then the payload in slices."""
    view = memoryview(payload)
    yield pb.ModelChunk(header=pb.ModelHeader(version=version, spec=spec_to_proto(spec),
                                              codec=codec, payload_bytes=len(view)))
    for start in range(0, len(view), chunk_bytes):
        yield pb.ModelChunk(data=bytes(view[start : start + chunk_bytes]))
