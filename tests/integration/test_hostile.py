"""Hostile requests against a live loopback server: each gets a precise status and a short
message, nothing is logged as a crash, and the model and the other clients carry on."""

from __future__ import annotations

import logging
import math
import threading

import grpc
import numpy as np
import pytest

from murmura.client import GrpcTransport, RemoteError
from murmura.protocols import DeviceProfile, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.server import AggregatorCore, ServerConfig

from .test_grpc import ONES, header, small_core, vector_spec
from .test_tier import seed_payload, seed_server, wait_until

pytestmark = pytest.mark.integration

METHODS = ("Join", "GetTask", "Pull", "Push", "Leave")


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> grpc.RpcError | None:
    """Send ``data`` as the request bytes of ``method`` (a stream of one message for Push)."""
    path = f"/murmura.v1.Aggregator/{method}"
    try:
        if method == "Push":
            channel.stream_unary(path)(iter([data]), timeout=5)
        elif method == "Pull":
            list(channel.unary_stream(path)(data, timeout=5))
        else:
            channel.unary_unary(path)(data, timeout=5)
    except grpc.RpcError as exc:
        return exc
    return None


@pytest.mark.parametrize("method", METHODS)
def test_undecodable_bytes_get_invalid_argument_and_no_traceback(serve, caplog, method) -> None:
    srv = serve(small_core())
    garbage = b"\xff\xff\xff\xff\x0f" + b"\x80" * 20  # a field tag that no parser accepts
    with caplog.at_level(logging.INFO), grpc.insecure_channel(srv.address) as ch:
        err = raw_call(ch, method, garbage)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.details()
    # (asyncio may log an earlier test's closed loop here; only our and grpc's loggers count)
    assert not [r for r in caplog.records if r.name.startswith(("murmura", "grpc"))
                and (r.levelno >= logging.ERROR or r.exc_info)]
    assert srv.call(lambda: srv.core.traffic.refused) == {"INVALID_ARGUMENT": 1}


def test_a_flood_of_refusals_logs_a_bounded_number_of_lines(serve, caplog) -> None:
    srv = serve(small_core())
    with caplog.at_level(logging.INFO, logger="murmura"), \
            grpc.insecure_channel(srv.address) as ch:
        for _ in range(200):
            raw_call(ch, "Join", b"\xff\xff\xff\xff\x0f")
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert 1 <= len(lines) <= 20
    assert srv.call(lambda: srv.core.traffic.refused) == {"INVALID_ARGUMENT": 200}


def test_refusals_never_echo_a_huge_input(serve) -> None:
    srv = serve(small_core())
    t = GrpcTransport(srv.address, timeout_s=5)
    a, _ = t.join("a", DeviceProfile())
    huge = "c" * (1 << 20)
    with pytest.raises(RemoteError) as err:
        t.push(header(a.session, ONES, codec=huge), ONES)
    assert err.value.status == "INVALID_ARGUMENT" and len(err.value.message) < 200
    with pytest.raises(RemoteError) as err:
        t.join("x" * 100_000, DeviceProfile())
    assert err.value.status == "INVALID_ARGUMENT" and len(err.value.message) < 200
    t.close()


@pytest.mark.parametrize("wait_s", [math.nan, math.inf, -math.inf])
def test_get_task_with_a_non_finite_wait_is_refused(serve, wait_s) -> None:
    srv = serve(small_core())
    with grpc.insecure_channel(srv.address) as ch:  # GrpcTransport would not send it
        stub = pb_grpc.AggregatorStub(ch)
        session = stub.Join(pb.JoinRequest(client_id="a"), timeout=5).session
        with pytest.raises(grpc.RpcError) as err:
            stub.GetTask(pb.TaskRequest(session=session, wait_s=wait_s), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "finite" in err.value.details()


@pytest.mark.parametrize("profile", [
    DeviceProfile(extra={"blob": "x" * (256 << 10)}),
    DeviceProfile(steps_per_s=math.nan),
    DeviceProfile(extra={f"k{i}": "v" for i in range(1000)}),
])
def test_an_oversized_or_insane_profile_is_refused_and_not_stored(serve, profile) -> None:
    srv = serve(small_core())
    t = GrpcTransport(srv.address, timeout_s=5)
    with pytest.raises(RemoteError) as err:
        t.join("a", profile)
    assert err.value.status == "INVALID_ARGUMENT"
    assert srv.call(lambda: len(srv.core.sessions)) == 0
    t.close()


def test_update_ids_with_control_characters_and_missing_fingerprints_are_refused(serve) -> None:
    srv = serve(small_core())
    t = GrpcTransport(srv.address, timeout_s=5)
    a, _ = t.join("a", DeviceProfile())
    for bad, message in ((dict(update_id="id\r\nSet-Cookie: x"), "control"),
                         (dict(spec_fingerprint=""), "spec_fingerprint is missing"),
                         (dict(metrics={"loss": math.nan}), "finite")):
        with pytest.raises(RemoteError) as err:
            t.push(header(a.session, ONES, **bad), ONES)
        assert err.value.status == "INVALID_ARGUMENT" and message in err.value.message
    assert srv.call(lambda: srv.core.traffic.updates) == 0
    t.close()


@pytest.mark.parametrize("values,n", [([1.7e38, 0, 0, 0], 10), ([3e38, 0, 0, 0], 1)])
def test_huge_finite_values_cannot_make_the_model_infinite(serve, values, n) -> None:
    srv = serve(small_core(min_clients=1, mode="async", buffer_size=2))
    t = GrpcTransport(srv.address, timeout_s=60)
    a, _ = t.join("a", DeviceProfile())
    b, _ = t.join("b", DeviceProfile())
    payload = np.asarray(values, "<f4").tobytes()
    refused = 0
    for s in (a.session, b.session):
        try:
            t.push(header(s, payload, round=0, num_examples=n), payload)
        except RemoteError as exc:
            assert exc.status == "INVALID_ARGUMENT" and "too large" in exc.message
            refused += 1
    assert refused >= 1
    for s in (a.session, b.session):  # the honest updates still make versions
        t.push(header(s, ONES, round=0), ONES)
    version, params = t.pull(a.session)
    assert version >= 1 and np.isfinite(params).all()
    t.close()


@pytest.mark.slow
def test_a_push_cancelled_while_it_is_decoded_does_not_count(serve) -> None:
    """The stream ended normally, then the client gave up while a worker decoded the update:
    the client saw CANCELLED, so the update must not count; its retry counts once."""
    size = 400_000
    srv = seed_server(serve, size, max_workers=1)
    payload = seed_payload(size, 1000)
    t = GrpcTransport(srv.address, timeout_s=120)
    s = t.join("a", DeviceProfile())[0].session
    h = header(s, payload, codec="seed", round=0, num_examples=1,
               spec_fingerprint=vector_spec(size).fingerprint())
    with grpc.insecure_channel(srv.address) as ch:
        push = ch.stream_unary("/murmura.v1.Aggregator/Push",
                               request_serializer=serde.serialize_update_item,
                               response_deserializer=pb.PushReply.FromString)
        call = push.future(serde.iter_update_items(h, payload), timeout=120)
        backend = srv.server.tier.backend
        wait_until(lambda: srv.call(lambda: backend.stats()["busy"]) == 1, what="a busy worker")
        call.cancel()
        wait_until(lambda: srv.call(lambda: backend.stats()["busy"]) == 0,
                   what="the decode to end", timeout=120)
    wait_until(lambda: srv.call(lambda: not srv.core._inflight), what="the push to end")
    assert srv.call(lambda: (srv.core.traffic.updates, srv.core.version)) == (0, 0)
    result = t.push(h, payload)  # the client's retry: counted once
    assert not result.duplicate
    assert srv.call(lambda: srv.core.traffic.updates) == 1
    assert t.push(h, payload).duplicate
    t.close()


def test_other_clients_carry_on_during_a_flood_of_garbage(serve) -> None:
    core: AggregatorCore = small_core(min_clients=1, mode="async", buffer_size=1)
    srv = serve(core)
    stop = threading.Event()

    def flood() -> None:
        with grpc.insecure_channel(srv.address) as ch:
            while not stop.is_set():
                raw_call(ch, "Push", b"\x0a\x05garbage")
    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        t = GrpcTransport(srv.address, timeout_s=10)
        a, _ = t.join("honest", DeviceProfile())
        for v in range(3):
            t.push(header(a.session, ONES, round=0, base_version=v), ONES)
        assert t.pull(a.session)[0] == 3
        t.close()
    finally:
        stop.set()
        flooder.join(10)
    assert srv.call(lambda: core.traffic.refused.get("INVALID_ARGUMENT", 0)) >= 1


def test_server_config_refuses_nonsense_limits() -> None:
    for bad in (dict(session_ttl_s=math.nan), dict(push_per_s=-1.0), dict(max_sessions=0)):
        with pytest.raises(ValueError):
            ServerConfig.from_flat(**bad)


def test_a_version_whose_step_overflows_is_dropped_and_the_server_carries_on(serve) -> None:
    srv = serve(small_core(min_clients=1, mode="async", buffer_size=1, server_lr=1e38))
    t = GrpcTransport(srv.address, timeout_s=60)
    a, _ = t.join("a", DeviceProfile())
    tens = np.full(4, 10.0, "<f4").tobytes()
    t.push(header(a.session, tens, round=0), tens)  # 1e38 x 10 overflows float32: dropped
    version, params = t.pull(a.session)
    assert version == 0 and params.tolist() == [0, 0, 0, 0]
    tiny = np.full(4, 1e-40, "<f4").tobytes()
    t.push(header(a.session, tiny, round=0), tiny)
    assert t.pull(a.session)[0] == 1
    t.close()
