"""Receiver processes (server/receivers.py) over real gRPC on loopback: pushes received in
their own processes give the gateway's model bit for bit, bad pushes get the gateway's exact
statuses and leave nothing behind, and a receiver that dies (idle or mid-push) is started
again while its clients' pushes still land."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator

import grpc
import numpy as np
import pytest

from murmura.client import GrpcTransport, RemoteError, transport
from murmura.protocols import (
    DeviceProfile,
    ModelSpec,
    TaskSettings,
    TensorSpec,
    UpdateHeader,
    create_codec,
    serde,
)
from murmura.protocols import murmura_pb2 as pb
from murmura.server import AggregatorCore, ServerConfig, ServerThread
from tests.conftest import wait_until
from tests.integration.test_worker_folds import run

pytestmark = pytest.mark.integration

SIZE = 1000
SPEC = ModelSpec((TensorSpec("w", (SIZE,)),))


def test_pushes_through_receivers_give_the_gateways_model_bit_for_bit(serve) -> None:
    """int8 updates, 2 workers folding them, sync and async: the same model whether the
    gateway or 2 receiver processes took the streams, and every push went to a receiver."""
    for mode in ("sync", "async"):
        kwargs = dict(workers=2, codec="int8", mode=mode, in_order=mode == "async")
        gateway, _ = run(serve, **kwargs)
        received, figures = run(serve, receivers=2, **kwargs)
        assert figures["receiver_pushes"] == 10 and figures["receivers"] == 2
        assert np.array_equal(received, gateway), f"{mode}: receivers changed the model"
        assert np.abs(gateway).sum() > 0


def _server(serve_list: list[ServerThread], **flat: object) -> ServerThread:
    config = ServerConfig.from_flat(**{
        "mode": "async", "buffer_size": 2, "max_versions": 100, "workers": 1, "receivers": 1,
        "require_identity": False, **flat})
    srv = ServerThread(AggregatorCore(config, SPEC, np.zeros(SIZE, np.float32)),
                       "127.0.0.1:0").start()
    serve_list.append(srv)
    return srv


@pytest.fixture
def servers() -> Iterator[list[ServerThread]]:
    running: list[ServerThread] = []
    yield running
    for srv in running:
        srv.stop(grace=None)


def _raw_push(address: str, items: Iterable[object]) -> tuple[str, str]:
    """Push ``items`` (chunk messages, payload views, or raw bytes sent as they are; a
    generator is sent as gRPC pulls it) on a fresh channel; the status name and details
    (``OK`` and the reply on success)."""
    def serialize(item: object) -> bytes:
        return item if isinstance(item, bytes) else serde.serialize_update_item(item)

    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary("/murmura.v1.Aggregator/Push", request_serializer=serialize,
                                    response_deserializer=pb.PushReply.FromString)
        try:
            reply = push(iter(items), timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", str(reply)


def _header(session: str, payload_bytes: int, **changes: object) -> pb.UpdateChunk:
    fields = dict(session=session, update_id=uuid.uuid4().hex[:12], base_version=0,
                  num_examples=3, codec="dense-f32", payload_bytes=payload_bytes,
                  spec_fingerprint=SPEC.fingerprint())
    fields.update(changes)
    return pb.UpdateChunk(header=serde.update_header_to_proto(UpdateHeader(**fields)))


def test_bad_pushes_get_the_gateways_statuses_from_a_receiver_and_lose_nothing(
        servers) -> None:
    srv = _server(servers)
    receivers = f"127.0.0.1:{srv.call(lambda: srv.server.push_port)}"
    t = GrpcTransport(srv.address)
    good = np.full(SIZE, 0.5, "<f4").tobytes()
    view = memoryview(good)
    cases = {  # each a function of a fresh session (some refusals end the session)
        "unknown session": lambda s: [_header("no-such-session", len(good)), view],
        "another model": lambda s: [_header(s, len(good), spec_fingerprint="f" * 16), view],
        "more payload than announced": lambda s: [_header(s, 8), view[:16]],
        "less payload than announced": lambda s: [_header(s, len(good)), view[:100]],
        "payload before the header": lambda s: [view[:8], _header(s, 8)],
        "two headers": lambda s: [_header(s, 8), _header(s, 8), view[:8]],
        "no header at all": lambda s: [],
        "a chunk that does not parse": lambda s: [b"\xff\xff\xff"],
        "a payload its codec refuses": lambda s: [_header(s, 6), view[:6]],
        "non-finite values": lambda s: [_header(s, 8),
                                        memoryview(np.array([np.nan, 1], "<f4").tobytes())],
    }
    for k, (what, items) in enumerate(cases.items()):
        answers = []
        for port, address in enumerate((srv.address, receivers)):
            session = t.join(f"c{k}-{port}", DeviceProfile())[0].session
            # a session's id is in some messages: compare them with it taken out
            status, details = _raw_push(address, items(session))
            answers.append((status, details.replace(session[:8], "<session>")))
        at_gateway, at_receiver = answers
        assert at_gateway[0] not in ("OK", "UNKNOWN", "UNAVAILABLE"), (what, at_gateway)
        assert at_receiver == at_gateway, f"{what}: the receiver answered {at_receiver}, " \
                                          f"the gateway {at_gateway}"
    session = t.join("a", DeviceProfile())[0].session
    refused = srv.call(lambda: sum(srv.core.traffic.refused.values()))
    assert refused == 2 * len(cases)
    wait_until(lambda: srv.call(lambda: srv.server.tier.slabs.in_use_bytes) == 0,
               what="every slab given back")
    assert srv.call(lambda: srv.core.version) == 0
    # the global model and the session carry on: two good pushes through the receiver
    for _ in range(2):
        assert _raw_push(receivers, [_header(session, len(good)), view])[0] == "OK"
    wait_until(lambda: srv.call(lambda: srv.core.version) == 1, what="version 1")
    np.testing.assert_array_equal(srv.call(lambda: srv.core.params.copy()), 0.5)
    assert srv.call(lambda: srv.server.receivers.stats())["receiver_pushes"] >= 3
    t.close()


def test_a_receiver_checks_int8_payloads_as_a_worker_would(servers) -> None:
    """Where workers fold int8 payloads from the slab, the receiver runs their check: a
    truncated payload and a NaN block scale get the gateway's statuses; good ones count."""
    srv = _server(servers, worker_folds="on", train=TaskSettings(codec="int8"))
    receivers = f"127.0.0.1:{srv.call(lambda: srv.server.push_port)}"
    t = GrpcTransport(srv.address)
    good = create_codec("int8", {}).encoder(SIZE, seed=1).encode(np.full(SIZE, 0.5, "<f4"))
    nan_scale = bytearray(good)
    nan_scale[4:8] = np.float32(np.nan).tobytes()  # the first block's scale (after the header)
    for k, bad in enumerate((good[:-3], bytes(nan_scale))):
        answers = []
        for port, address in enumerate((srv.address, receivers)):
            session = t.join(f"c{k}-{port}", DeviceProfile())[0].session
            status, details = _raw_push(address, [_header(session, len(bad), codec="int8"),
                                                  memoryview(bad)])
            answers.append((status, details.replace(session[:8], "<session>")))
        assert answers[0][0] == "INVALID_ARGUMENT" and answers[1] == answers[0], answers
    session = t.join("a", DeviceProfile())[0].session
    for _ in range(2):
        assert _raw_push(receivers, [_header(session, len(good), codec="int8"),
                                     memoryview(good)])[0] == "OK"
    wait_until(lambda: srv.call(lambda: srv.core.version) == 1, what="version 1")
    np.testing.assert_allclose(srv.call(lambda: srv.core.params.copy()), 0.5, atol=1e-2)
    assert srv.call(lambda: srv.core.folds.folded) == 2  # folded from the slab by workers
    assert srv.call(srv.server.receivers.stats)["receiver_checks"] == 4  # 2 bad, 2 good
    t.close()


def test_a_killed_receiver_is_started_again_and_its_clients_pushes_land(
        servers, monkeypatch) -> None:
    monkeypatch.setattr(transport, "PUSH_PORT_RETRY_S", 0.2)  # try the port again soon
    srv = _server(servers)
    port = srv.call(lambda: srv.server.push_port)
    t = GrpcTransport(srv.address, timeout_s=30)
    session = t.join("a", DeviceProfile())[0].session
    assert t.push_address == f"127.0.0.1:{port}"
    payload = np.full(SIZE, 0.25, "<f4").tobytes()

    def push() -> None:
        result = t.push(UpdateHeader(session=session, update_id=uuid.uuid4().hex[:12],
                                     base_version=0, num_examples=1, codec="dense-f32",
                                     payload_bytes=len(payload),
                                     spec_fingerprint=SPEC.fingerprint()), payload)
        assert not result.duplicate

    hub = srv.server.receivers
    (pid,) = srv.call(lambda: hub.pids)
    os.kill(pid, signal.SIGKILL)
    push()  # to the gateway, or to the new receiver if it is up within the connect timeout
    wait_until(lambda: {k: v for k, v in srv.call(hub.stats).items()
                        if k in ("receivers", "receiver_restarts")}
               == {"receivers": 1, "receiver_restarts": 1},
               timeout=60, what="the receiver started again")
    assert srv.call(lambda: hub.port) == port  # on the same port

    deadline = time.monotonic() + 30
    while srv.call(hub.stats)["receiver_pushes"] == 0:  # the gateway's until the client's
        assert time.monotonic() < deadline, "no push reached the new receiver"  # channel
        push()                                         # reconnects (gRPC's backoff, ~1 s)
        time.sleep(0.25)
    pushes = srv.call(lambda: srv.core.traffic.updates)
    assert pushes >= 1 and srv.call(lambda: srv.core.version) == pushes // 2
    t.close()


def test_a_push_port_that_never_answers_costs_one_wait_then_the_gateway_takes_pushes(
        servers) -> None:
    """A port where TCP connects but nothing speaks HTTP/2 (as behind a firewall that drops
    packets, gRPC would wait its own 20 s per attempt): the first push waits the connect
    timeout and goes to the gateway, the next ones go there at once."""
    srv = _server(servers)
    t = GrpcTransport(srv.address, timeout_s=30, connect_timeout_s=1.0)
    session = t.join("a", DeviceProfile())[0].session
    payload = np.full(SIZE, 0.25, "<f4").tobytes()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # never accepted: connections complete, no answer ever comes
        t._use_push_port(silent.getsockname()[1])
        for k in range(3):
            started = time.monotonic()
            result = t.push(UpdateHeader(session=session, update_id=f"u{k}", base_version=0,
                                         num_examples=1, codec="dense-f32",
                                         payload_bytes=len(payload),
                                         spec_fingerprint=SPEC.fingerprint()), payload)
            assert not result.duplicate
            assert time.monotonic() - started < 15  # not gRPC's 20 s handshake wait
            assert t._push_port_retry_at > time.monotonic()  # the port is left alone
    assert srv.call(lambda: srv.core.traffic.updates) == 3
    assert srv.call(srv.server.receivers.stats)["receiver_pushes"] == 0
    t.close()


def test_a_receiver_killed_mid_push_gives_its_slab_back(servers) -> None:
    srv = _server(servers)
    receivers = f"127.0.0.1:{srv.call(lambda: srv.server.push_port)}"
    t = GrpcTransport(srv.address)
    session = t.join("a", DeviceProfile())[0].session
    t.close()
    payload = memoryview(np.ones(SIZE, "<f4").tobytes())
    release = threading.Event()

    def items() -> Iterator[object]:
        yield _header(session, len(payload))
        yield payload[:1000]
        release.wait(30)  # the rest never comes: the receiver holds a lent slab meanwhile

    outcome: list[tuple[str, str]] = []
    pusher = threading.Thread(target=lambda: outcome.append(_raw_push(receivers, items())))
    pusher.start()
    slabs = srv.server.tier.slabs
    wait_until(lambda: srv.call(lambda: slabs.in_use_bytes) > 0, what="a slab lent")
    (pid,) = srv.call(lambda: srv.server.receivers.pids)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: srv.call(lambda: slabs.in_use_bytes) == 0, what="the slab given back")
    release.set()
    pusher.join(30)
    assert outcome and outcome[0][0] == "UNAVAILABLE"  # the client retries elsewhere
    assert srv.call(lambda: srv.core.traffic.updates) == 0
    wait_until(lambda: srv.call(srv.server.receivers.stats)["receivers"] == 1, timeout=60,
               what="the receiver started again")


def test_back_pressure_reaches_the_client_through_a_receiver_with_its_retry_hint(
        servers) -> None:
    """The tier's shared memory full (a stalled push holds the only slab that fits): a push
    through a receiver is refused RESOURCE_EXHAUSTED with the gateway's retry hint in its
    trailing metadata, and lands once the memory is free."""
    srv = _server(servers, slab_mb=1)  # one slab (the smallest there is): one push at a time
    receivers = f"127.0.0.1:{srv.call(lambda: srv.server.push_port)}"
    t = GrpcTransport(srv.address, timeout_s=30)
    session = t.join("a", DeviceProfile())[0].session
    payload = np.full(SIZE, 0.5, "<f4").tobytes()
    release = threading.Event()

    def stalled() -> Iterator[object]:
        yield _header(session, len(payload))
        yield memoryview(payload)[:100]
        release.wait(30)

    pusher = threading.Thread(target=lambda: _raw_push(receivers, stalled()))
    pusher.start()
    slabs = srv.server.tier.slabs
    wait_until(lambda: srv.call(lambda: slabs.in_use_bytes) > 0, what="a slab lent")
    header = UpdateHeader(session=session, update_id="second", base_version=0,
                          num_examples=1, codec="dense-f32", payload_bytes=len(payload),
                          spec_fingerprint=SPEC.fingerprint())
    with pytest.raises(RemoteError) as refused:
        t.push(header, payload)
    assert refused.value.status == "RESOURCE_EXHAUSTED"
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    release.set()
    pusher.join(30)
    wait_until(lambda: srv.call(lambda: slabs.in_use_bytes) == 0, what="the slab given back")
    assert not t.push(header, payload).duplicate  # the same update, retried: it lands
    assert srv.call(srv.server.receivers.stats)["receiver_pushes"] == 1
    t.close()


def test_a_push_port_in_use_is_refused_naming_the_flag_and_nothing_is_left_running() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = ServerConfig.from_flat(workers=1, receivers=1, require_identity=False,
                                        push_port=busy.getsockname()[1])
        core = AggregatorCore(config, SPEC, np.zeros(SIZE, np.float32))
        srv = ServerThread(core, "127.0.0.1:0")
        with pytest.raises(ValueError, match="--push-port: receiver 0 could not serve"):
            srv.start()
    assert _receiver_children() == []  # stopped, with the server's gRPC port and its tier
    assert srv.server.tier is None and srv.server.receivers is None


def _receiver_children() -> list[int]:
    """Live receiver processes started by this process."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"murmura.server.receiver_process" in command:
            found.append(int(entry))
    return found


def test_receivers_need_worker_processes_and_a_port_needs_receivers() -> None:
    with pytest.raises(ValueError, match="receivers write payloads into the tier's shared"):
        ServerConfig.from_flat(workers=0, receivers=2)
    with pytest.raises(ValueError, match="push_port is the receivers' port"):
        ServerConfig.from_flat(push_port=5000)
    with pytest.raises(ValueError, match="receivers must be >= 0"):
        ServerConfig.from_flat(receivers=-1)
    assert ServerConfig.from_flat(receivers=2, push_port=5000).tier.receivers == 2
