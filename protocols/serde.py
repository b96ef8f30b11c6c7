"""Conversions between the plain types and the generated protobuf messages, in pairs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.messages import (
    Action,
    DeviceProfile,
    JoinProof,
    JoinResult,
    PeerInfo,
    PeerModelHeader,
    PushResult,
    Task,
    TaskSettings,
    UpdateHeader,
)
from murmura.protocols.secagg.weighted import SecAggParams
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
                           zo_eps=s.zo_eps, client_eval_every=s.client_eval_every)


def settings_from_proto(m: pb.TaskSettings) -> TaskSettings:
    return TaskSettings(trainer=m.trainer, local_epochs=m.local_epochs,
                        local_steps=m.local_steps, batch_size=m.batch_size, lr=m.lr,
                        momentum=m.momentum, codec=m.codec,
                        codec_options=dict(m.codec_options), seed=m.seed,
                        zo_eps=m.zo_eps or 1e-3,
                        client_eval_every=max(m.client_eval_every, 0))


def task_to_proto(t: Task) -> pb.TaskReply:
    return pb.TaskReply(action=t.action.name, version=t.version, round=t.round,
                        retry_after_s=t.retry_after_s, seed=t.seed,
                        local_steps=t.local_steps)


def task_from_proto(m: pb.TaskReply) -> Task:
    return Task(action=Action(m.action), version=m.version, round=m.round,
                retry_after_s=m.retry_after_s, seed=m.seed, local_steps=m.local_steps)


def update_header_to_proto(h: UpdateHeader) -> pb.UpdateHeader:
    return pb.UpdateHeader(session=h.session, update_id=h.update_id,
                           base_version=h.base_version, round=h.round,
                           num_examples=h.num_examples, codec=h.codec,
                           payload_bytes=h.payload_bytes, metrics=dict(h.metrics),
                           spec_fingerprint=h.spec_fingerprint, signature=h.signature)


def update_header_from_proto(m: pb.UpdateHeader) -> UpdateHeader:
    return UpdateHeader(session=m.session, update_id=m.update_id,
                        base_version=m.base_version, round=m.round,
                        num_examples=m.num_examples, codec=m.codec,
                        payload_bytes=m.payload_bytes, metrics=dict(m.metrics),
                        spec_fingerprint=m.spec_fingerprint, signature=m.signature)


def join_proof_from_proto(m: pb.JoinRequest) -> JoinProof | None:
    """The identity proof of a Join, or None when it carries none."""
    if not (m.public_key or m.nonce or m.signature):
        return None
    return JoinProof(public_key=m.public_key, nonce=m.nonce, signature=m.signature)


def secagg_params_to_proto(p: SecAggParams | None) -> pb.SecAggParams:
    if p is None:
        return pb.SecAggParams()
    return pb.SecAggParams(enabled=True, bits=p.bits, clip=p.clip, max_weight=p.max_weight,
                           dp_clip=p.dp_clip, dp_noise_multiplier=p.dp_noise_multiplier)


def secagg_params_from_proto(m: pb.SecAggParams) -> SecAggParams | None:
    """The run's secure-aggregation encoding, or None when it is off (``ValueError`` for
    parameters no client could use)."""
    if not m.enabled:
        return None
    return SecAggParams(bits=m.bits, clip=m.clip, max_weight=m.max_weight,
                        dp_clip=m.dp_clip, dp_noise_multiplier=m.dp_noise_multiplier)


def join_result_to_proto(r: JoinResult, spec: ModelSpec) -> pb.JoinReply:
    return pb.JoinReply(session=r.session, settings=settings_to_proto(r.settings),
                        spec=spec_to_proto(spec), mode=r.mode,
                        max_payload_bytes=r.max_payload_bytes,
                        secagg=secagg_params_to_proto(r.secagg), push_port=r.push_port)


def join_result_from_proto(m: pb.JoinReply) -> tuple[JoinResult, ModelSpec]:
    result = JoinResult(session=m.session, settings=settings_from_proto(m.settings),
                        mode=m.mode, max_payload_bytes=m.max_payload_bytes,
                        secagg=secagg_params_from_proto(m.secagg), push_port=m.push_port)
    return result, spec_from_proto(m.spec)


def push_result_to_proto(r: PushResult) -> pb.PushReply:
    return pb.PushReply(duplicate=r.duplicate, version=r.version, staleness=r.staleness)


def push_result_from_proto(m: pb.PushReply) -> PushResult:
    return PushResult(duplicate=m.duplicate, version=m.version, staleness=m.staleness)


def _varint_len(n: int) -> int:
    length = 1
    while n >= 0x80:
        n >>= 7
        length += 1
    return length


def data_chunk_wire_bytes(n: int) -> int:
    """Serialized size of a chunk message carrying ``n`` payload bytes in its ``data`` field
    (one tag byte, the varint length, the bytes): ``chunk.ByteSize()`` without the call."""
    return 1 + _varint_len(n) + n


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


# -- zero-copy chunk framing ------------------------------------------------------------------
# A payload chunk on the wire is the protobuf encoding of ``UpdateChunk``/``ModelChunk`` with
# only ``data`` set: tag 0x12 (field 2, length-delimited), a varint length, the bytes. Writing
# and reading that frame directly saves building a message, serialising it, parsing it and
# copying ``.data`` out (four passes over every payload byte) while staying byte-identical to
# the proto, so any protobuf peer interoperates.

_DATA_TAG = 0x12


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame_data(data: bytes | memoryview) -> bytes:
    """The wire bytes of a chunk message carrying only ``data``."""
    return b"".join((bytes((_DATA_TAG,)), _varint(len(data)), data))


def _data_view(raw: bytes) -> memoryview | None:
    """The payload of a data-only chunk frame, without copying; None for any other message."""
    if not raw or raw[0] != _DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(raw) and pos < 11:
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            break
        shift += 7
    else:
        return None
    return memoryview(raw)[pos:] if pos + length == len(raw) else None


def serialize_update_item(item: pb.UpdateChunk | bytes | memoryview) -> bytes:
    """Request serializer for Push: a header message, or raw payload bytes to frame."""
    if isinstance(item, pb.UpdateChunk):
        return item.SerializeToString()
    return frame_data(item)


def deserialize_update_item(raw: bytes) -> pb.UpdateChunk | memoryview:
    """Request deserializer for Push: payload chunks as zero-copy views, other chunks parsed."""
    view = _data_view(raw)
    return view if view is not None else pb.UpdateChunk.FromString(raw)


def serialize_model_item(item: pb.ModelChunk | bytes | memoryview) -> bytes:
    """Response serializer for Pull (same framing as Push)."""
    if isinstance(item, pb.ModelChunk):
        return item.SerializeToString()
    return frame_data(item)


def deserialize_model_item(raw: bytes) -> pb.ModelChunk | memoryview:
    view = _data_view(raw)
    return view if view is not None else pb.ModelChunk.FromString(raw)


def iter_update_items(header: UpdateHeader, payload: bytes | memoryview,
                      chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.UpdateChunk | memoryview]:
    """Push stream items for :func:`serialize_update_item`: the header, then payload views."""
    yield pb.UpdateChunk(header=update_header_to_proto(header))
    view = memoryview(payload).cast("B")
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


def iter_model_items(version: int, spec: ModelSpec | None, codec: str,
                     payload: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES, *,
                     base_version: int = 0) -> Iterator[pb.ModelChunk | memoryview]:
    """Pull stream items for :func:`serialize_model_item`: the header, then payload views.

    ``spec`` None leaves it out of the header (a seed pool's scalars are not a model).
    """
    view = memoryview(payload).cast("B")
    yield pb.ModelChunk(header=pb.ModelHeader(
        version=version, spec=spec_to_proto(spec) if spec is not None else None, codec=codec,
        payload_bytes=len(view), base_version=base_version))
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


# -- gossip mode ------------------------------------------------------------------------------

def peer_info_to_proto(p: PeerInfo) -> pb.PeerInfo:
    return pb.PeerInfo(peer_id=p.peer_id, address=p.address, round=p.round, age=p.age,
                       public_key=p.public_key)


def peer_info_from_proto(m: pb.PeerInfo) -> PeerInfo:
    return PeerInfo(peer_id=m.peer_id, address=m.address, round=m.round, age=m.age,
                    public_key=bytes(m.public_key))


def history_to_proto(records: Sequence[tuple[str, int, Any]]) -> list[pb.HistoryRecord]:
    """``(peer_id, round, sketch)`` records for a PeerExchange."""
    return [pb.HistoryRecord(peer_id=p, round=r, sketch=[float(v) for v in sk])
            for p, r, sk in records]


def history_from_proto(records: Sequence[pb.HistoryRecord]) -> list[tuple[str, int, list[float]]]:
    return [(m.peer_id, m.round, list(m.sketch)) for m in records]


#: Bounds on a PeerStepLogs reply a catching-up peer accepts.
MAX_LOG_ROUNDS, MAX_LOGS_PER_ROUND = 10_000, 4096


def step_logs_to_proto(snapshot_round: int, sha256: bytes,
                       rounds: Sequence[tuple[int, Sequence[tuple[str, bytes]]]]
                       ) -> pb.PeerStepLogs:
    return pb.PeerStepLogs(snapshot_round=snapshot_round, snapshot_sha256=sha256, rounds=[
        pb.PeerRoundLogs(round=r, logs=[pb.PeerStepLog(peer_id=p, payload=b) for p, b in logs])
        for r, logs in rounds])


def step_logs_from_proto(m: pb.PeerStepLogs
                         ) -> tuple[int, bytes, list[tuple[int, list[tuple[str, bytes]]]]]:
    """The reply's (snapshot round, digest, rounds); ValueError when it is implausible
    (rounds out of order, too many, a round without logs, a digest of the wrong size)."""
    if len(m.snapshot_sha256) != 32 or m.snapshot_round < 0:
        raise ValueError("step logs: a snapshot needs a round >= 0 and a 32-byte SHA-256")
    if len(m.rounds) > MAX_LOG_ROUNDS:
        raise ValueError(f"step logs: {len(m.rounds)} rounds, at most {MAX_LOG_ROUNDS}")
    rounds: list[tuple[int, list[tuple[str, bytes]]]] = []
    last = m.snapshot_round - 1
    for r in m.rounds:
        if r.round <= last or not 0 < len(r.logs) <= MAX_LOGS_PER_ROUND:
            raise ValueError(f"step logs: round {r.round} is out of order or has "
                             f"{len(r.logs)} logs")
        last = r.round
        rounds.append((r.round, [(log.peer_id, bytes(log.payload)) for log in r.logs]))
    return m.snapshot_round, bytes(m.snapshot_sha256), rounds


def peer_model_header_to_proto(h: PeerModelHeader) -> pb.PeerModelHeader:
    return pb.PeerModelHeader(sender=peer_info_to_proto(h.sender), message_id=h.message_id,
                              round=h.round, num_examples=h.num_examples, codec=h.codec,
                              payload_bytes=h.payload_bytes,
                              spec_fingerprint=h.spec_fingerprint, signature=h.signature,
                              kind=h.kind)


def peer_model_header_from_proto(m: pb.PeerModelHeader) -> PeerModelHeader:
    return PeerModelHeader(sender=peer_info_from_proto(m.sender), message_id=m.message_id,
                           round=m.round, num_examples=m.num_examples, codec=m.codec,
                           payload_bytes=m.payload_bytes, spec_fingerprint=m.spec_fingerprint,
                           signature=m.signature, kind=m.kind)


def serialize_peer_item(item: pb.PeerChunk | bytes | memoryview) -> bytes:
    """Request serializer for PushModel: a header message, or raw payload bytes to frame
    (``PeerChunk.data`` is field 2 like ``UpdateChunk.data``, so the framing is the same)."""
    if isinstance(item, pb.PeerChunk):
        return item.SerializeToString()
    return frame_data(item)


def deserialize_peer_item(raw: bytes) -> pb.PeerChunk | memoryview:
    view = _data_view(raw)
    return view if view is not None else pb.PeerChunk.FromString(raw)


def iter_peer_items(header: PeerModelHeader, payload: bytes | memoryview,
                    chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.PeerChunk | memoryview]:
    """PushModel stream items for :func:`serialize_peer_item`: the header, then payload views."""
    yield pb.PeerChunk(header=peer_model_header_to_proto(header))
    view = memoryview(payload).cast("B")
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


# -- undecodable requests -----------------------------------------------------------------

class Malformed:
    """What a request deserializer returns for bytes that are not the expected message.

    gRPC answers a deserializer's exception with a bare status and a traceback in the server's
    log (tens of MB from a fuzzer); returning this marker lets the handler refuse with
    INVALID_ARGUMENT and a short message instead (the aggregator and gossip peers both do).
    """

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


def tolerant(parse: Callable[[bytes], Any], what: str) -> Callable[[bytes], Any]:
    """``parse`` that returns :class:`Malformed` instead of raising."""
    def run(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception:  # noqa: BLE001 - any parse failure is the sender's malformed input
            return Malformed(what)
    return run
