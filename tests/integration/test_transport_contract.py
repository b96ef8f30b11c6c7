"""The transport contract, run against every client transport over a real core.

A client must not be able to tell which transport it talks through: the same calls give the
same answers and the same refusals (gRPC status names) over gRPC on loopback (a real server,
an ephemeral port), the simulator's in-memory transport, and the test transport that calls
the core directly. A transport that answers differently (another status for a bad payload, a
refusal that changes the model) fails here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from murmura.client import GrpcTransport, RemoteError
from murmura.client.transport import Transport
from murmura.protocols import Action, DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.protocols.identity import NodeKey, payload_digest
from murmura.server import AggregatorCore, ServerConfig, ServerThread
from murmura.simulation.transport import LocalAggregator
from tests.client.core_transport import CoreTransport

P = 64
SPEC = ModelSpec((TensorSpec("w", (8, 8)),))
P0 = np.linspace(-1, 1, P).astype(np.float32)


def _grpc(core: AggregatorCore) -> tuple[Transport, Callable[[], None]]:
    srv = ServerThread(core, "127.0.0.1:0").start()
    transport = GrpcTransport(srv.address, timeout_s=30)

    def stop() -> None:
        transport.close()
        srv.stop(grace=None)
    return transport, stop


def _memory(core: AggregatorCore) -> tuple[Transport, Callable[[], None]]:
    return LocalAggregator(core).transport(), lambda: None


def _direct(core: AggregatorCore) -> tuple[Transport, Callable[[], None]]:
    return CoreTransport(core), lambda: None


TRANSPORTS = {"grpc": _grpc, "memory": _memory, "direct": _direct}


@pytest.fixture(params=sorted(TRANSPORTS))
def connect(request) -> Iterator[Callable[..., tuple[AggregatorCore, Transport]]]:
    stops: list[Callable[[], None]] = []

    def make(**cfg: object) -> tuple[AggregatorCore, Transport]:
        config = {"mode": "async", "buffer_size": 1, "min_clients": 1, "max_versions": 10,
                  "workers": 0, "require_identity": False, **cfg}
        core = AggregatorCore(ServerConfig.from_flat(**config), SPEC, P0.copy())  # type: ignore[arg-type]
        transport, stop = TRANSPORTS[request.param](core)
        stops.append(stop)
        return core, transport

    yield make
    for stop in stops:
        stop()


def header_for(core: AggregatorCore, session: str, payload: bytes, *, uid: str,
               **change: object) -> UpdateHeader:
    header = UpdateHeader(session=session, update_id=uid, base_version=core.version,
                          num_examples=10, codec="dense-f32", payload_bytes=len(payload),
                          spec_fingerprint=core.fingerprint)
    return dataclasses.replace(header, **change)  # type: ignore[arg-type]


def status_of(call: Callable[[], object]) -> str:
    with pytest.raises(RemoteError) as err:
        call()
    return err.value.status


def test_join_task_pull_push_and_leave(connect) -> None:
    core, t = connect()
    result, spec = t.join("alice", DeviceProfile())
    assert spec.fingerprint() == SPEC.fingerprint() and result.session
    task = t.task(result.session, 0)
    assert task.action == Action.TRAIN and task.version == 0
    version, params = t.pull(result.session)
    assert version == 0 and params.tobytes() == P0.tobytes()
    params[:] = 0  # a writable copy: the server's model is untouched
    update = np.full(P, 0.5, np.float32).tobytes()
    reply = t.push(header_for(core, result.session, update, uid="u1"), update)
    assert reply.version == 1 and not reply.duplicate
    again = t.push(header_for(core, result.session, update, uid="u1", base_version=0), update)
    assert again.duplicate and core.version == 1
    version, params = t.pull(result.session)
    assert version == 1 and params.tobytes() == core.params.tobytes()
    assert not np.array_equal(params, P0)
    t.leave(result.session)
    assert status_of(lambda: t.task(result.session, 0)) == "UNAUTHENTICATED"


def test_a_proven_identity_signs_its_pushes(connect) -> None:
    core, t = connect(require_identity=True)
    key, other = NodeKey.from_seed(b"contract-a"), NodeKey.from_seed(b"contract-b")
    result, _ = t.join_as(key, DeviceProfile())
    assert core.sessions[result.session].client_id == key.client_id
    payload = np.ones(P, "<f4").tobytes()
    forged = other.sign_update(header_for(core, result.session, payload, uid="f"),
                               payload_digest(payload))
    assert status_of(lambda: t.push(forged, payload)) == "PERMISSION_DENIED"
    signed = key.sign_update(header_for(core, result.session, payload, uid="s"),
                             payload_digest(payload))
    assert t.push(signed, payload).version == 1


BAD_PUSHES: dict[str, tuple[Callable[[AggregatorCore, str], tuple[UpdateHeader, bytes]], str]] = {
    "NaN in the update": (
        lambda core, s: (header_for(core, s, np.full(P, np.nan, "<f4").tobytes(), uid="b1"),
                         np.full(P, np.nan, "<f4").tobytes()), "INVALID_ARGUMENT"),
    "payload shorter than its header says": (
        lambda core, s: (header_for(core, s, b"\0" * 4 * P, uid="b2", payload_bytes=4 * P),
                         b"\0" * (4 * P - 4)), "INVALID_ARGUMENT"),
    "another model's update": (
        lambda core, s: (header_for(core, s, b"\0" * 4 * P, uid="b3",
                                    spec_fingerprint="0" * 16), b"\0" * 4 * P),
        "FAILED_PRECONDITION"),
    "unknown codec": (
        lambda core, s: (header_for(core, s, b"\0" * 4 * P, uid="b4", codec="zip"),
                         b"\0" * 4 * P), "INVALID_ARGUMENT"),
    "a version from the future": (
        lambda core, s: (header_for(core, s, b"\0" * 4 * P, uid="b5", base_version=7),
                         b"\0" * 4 * P), "INVALID_ARGUMENT"),
    "no examples": (
        lambda core, s: (header_for(core, s, b"\0" * 4 * P, uid="b6", num_examples=0),
                         b"\0" * 4 * P), "INVALID_ARGUMENT"),
    "an unknown session": (
        lambda core, s: (header_for(core, "no-such-session", b"\0" * 4 * P, uid="b7"),
                         b"\0" * 4 * P), "UNAUTHENTICATED"),
}


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_a_bad_push_gets_the_same_status_and_changes_nothing(connect, case: str) -> None:
    core, t = connect()
    other, _ = t.join("bob", DeviceProfile())
    result, _ = t.join("alice", DeviceProfile())
    make, want = BAD_PUSHES[case]
    header, payload = make(core, result.session)
    assert status_of(lambda: t.push(header, payload)) == want
    assert core.version == 0 and core.params.tobytes() == P0.tobytes()
    assert core.traffic.updates == 0
    # and every client carries on: a good update from another session still counts
    good = np.full(P, 0.25, np.float32).tobytes()
    assert t.push(header_for(core, other.session, good, uid="ok"), good).version == 1
