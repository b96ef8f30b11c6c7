"""TLS, mutual TLS and identities over real gRPC on loopback, with certificates made by the
same code as ``murmura certs`` into tmp_path."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from murmura.client import ClientRuntime, FunctionTrainer, GrpcTransport, RemoteError
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.protocols.identity import NodeKey, payload_digest
from murmura.protocols.tls import (
    ClientTls,
    TlsError,
    make_ca,
    make_client_cert,
    make_server_cert,
)
from murmura.server import AggregatorCore, ServerConfig, ServerThread

pytestmark = pytest.mark.integration

SPEC = ModelSpec((TensorSpec("w", (4,)),))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA with a server and a client certificate, and a second, unrelated CA with a client
    certificate of its own."""
    root = tmp_path_factory.mktemp("pki")
    make_ca(root / "ca")
    make_server_cert(root / "ca", root / "server", ["localhost", "127.0.0.1"])
    make_client_cert(root / "ca", root / "clients", "alice")
    make_ca(root / "evil-ca")
    make_client_cert(root / "evil-ca", root / "evil", "mallory")
    return {"root": root, "ca": root / "ca" / "ca.crt", "cert": root / "server" / "server.crt",
            "key": root / "server" / "server.key", "client_cert": root / "clients" / "alice.crt",
            "client_key": root / "clients" / "alice.key",
            "evil_ca": root / "evil-ca" / "ca.crt", "evil_cert": root / "evil" / "mallory.crt",
            "evil_key": root / "evil" / "mallory.key"}


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    running: list[ServerThread] = []

    def start(**cfg) -> ServerThread:
        cfg.setdefault("min_clients", 2)
        cfg.setdefault("max_versions", 1)
        core = AggregatorCore(ServerConfig.from_flat(**cfg), SPEC, np.zeros(4, np.float32))
        srv = ServerThread(core, "127.0.0.1:0").start()
        running.append(srv)
        return srv

    yield start
    for srv in running:
        srv.stop(grace=None)


def train_two_clients(srv: ServerThread, tls: ClientTls | None) -> list[ClientRuntime]:
    """Two clients with fresh keys train until the server stops them."""
    def train_by(step: float) -> Callable[..., dict[str, int]]:
        def fn(m, settings, seed):
            with torch.no_grad():
                m.w.add_(step)
            return {"num_examples": 1}
        return fn

    runtimes = []
    for step in (1.0, 2.0):
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(4))
        runtimes.append(ClientRuntime(GrpcTransport(srv.address, timeout_s=10, tls=tls),
                                      FunctionTrainer(model, train_by(step)), wait_s=0.5))
    threads = [threading.Thread(target=rt.run) for rt in runtimes]
    for th in threads:
        th.start()
    assert srv.wait_done(timeout=60)
    for th in threads:
        th.join(timeout=30)
    for rt in runtimes:
        rt.transport.close()
    return runtimes


#: A failed handshake: the channel never becomes ready (the client waits for readiness, so
#: the call ends at its deadline) or fails fast; either way nothing reaches the aggregator.
NO_CONNECTION = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def refused_join(address: str, tls: ClientTls | None) -> RemoteError:
    t = GrpcTransport(address, timeout_s=1.5, tls=tls)
    try:
        with pytest.raises(RemoteError) as err:
            t.join_as(NodeKey.generate(), DeviceProfile())
    finally:
        t.close()
    return err.value


def test_tls_server_trains_signed_clients_and_refuses_plaintext(serve, pki) -> None:
    srv = serve(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]))
    runtimes = train_two_clients(srv, ClientTls(str(pki["ca"])))
    assert srv.call(lambda: srv.core.version) == 1
    np.testing.assert_allclose(srv.call(lambda: srv.core.params.copy()), [1.5] * 4)
    assert all(rt.stats.pushed == 1 for rt in runtimes)
    assert all(rt.client_id.startswith("n-") for rt in runtimes)  # ephemeral keys' ids
    plaintext = refused_join(srv.address, None)  # named, not retried (tests/client)
    assert plaintext.status == "FAILED_PRECONDITION" and "speaks TLS" in plaintext.message
    # another CA: named, with the flag to change and who issued the server's certificate
    wrong_ca = refused_join(srv.address, ClientTls(str(pki["evil_ca"])))
    assert wrong_ca.status == "FAILED_PRECONDITION"
    assert "not signed by the CA in --tls-ca" in wrong_ca.message
    assert str(pki["evil_ca"]) in wrong_ca.message


def test_a_server_certificate_for_other_names_is_named(serve, pki) -> None:
    make_server_cert(pki["root"] / "ca", pki["root"] / "elsewhere", ["example.org"])
    srv = serve(tls_cert=str(pki["root"] / "elsewhere" / "server.crt"),
                tls_key=str(pki["root"] / "elsewhere" / "server.key"))
    err = refused_join(srv.address, ClientTls(str(pki["ca"])))
    assert err.status == "FAILED_PRECONDITION"
    assert "not issued for '127.0.0.1'" in err.message and "example.org" in err.message
    assert srv.call(lambda: len(srv.core.sessions)) == 0


def test_mutual_tls_refuses_clients_without_a_valid_certificate(serve, pki) -> None:
    srv = serve(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), client_ca=str(pki["ca"]))
    ca = str(pki["ca"])
    missing = refused_join(srv.address, ClientTls(ca))  # no certificate: named
    assert missing.status == "FAILED_PRECONDITION"
    assert "requires a client certificate" in missing.message and "--tls-cert" in missing.message
    other = ClientTls(ca, str(pki["evil_cert"]), str(pki["evil_key"]))     # another CA's
    refused = refused_join(srv.address, other)
    assert refused.status == "FAILED_PRECONDITION"
    assert "refused this client's certificate" in refused.message
    assert str(pki["evil_cert"]) in refused.message
    assert srv.call(lambda: len(srv.core.sessions)) == 0
    runtimes = train_two_clients(srv, ClientTls(ca, str(pki["client_cert"]),
                                                str(pki["client_key"])))
    assert srv.call(lambda: srv.core.version) == 1
    assert all(rt.stats.pushed == 1 and rt.stats.refused == 0 for rt in runtimes)


def test_receivers_speak_the_servers_mutual_tls_and_take_signed_updates(serve, pki) -> None:
    """Receiver processes (--receivers) serve their port with the server's certificate and
    its client CA: signed updates of mutual-TLS clients land through them; a client without
    a certificate, or without TLS, reaches nothing there."""
    srv = serve(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), client_ca=str(pki["ca"]),
                workers=1, receivers=1)
    ca = str(pki["ca"])
    runtimes = train_two_clients(srv, ClientTls(ca, str(pki["client_cert"]),
                                                str(pki["client_key"])))
    assert srv.call(lambda: srv.core.version) == 1
    np.testing.assert_allclose(srv.call(lambda: srv.core.params.copy()), [1.5] * 4)
    assert all(rt.stats.pushed == 1 and rt.stats.refused == 0 for rt in runtimes)
    assert srv.call(srv.server.receivers.stats)["receiver_pushes"] == 2
    port = srv.call(lambda: srv.server.push_port)
    for creds in (None, grpc.ssl_channel_credentials(pki["ca"].read_bytes())):
        address = f"127.0.0.1:{port}"
        channel = grpc.insecure_channel(address) if creds is None else \
            grpc.secure_channel(address, creds)  # TLS, but no client certificate
        with channel:
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=1.5)


def test_identity_refusals_carry_precise_grpc_statuses(serve) -> None:
    srv = serve(min_clients=1, mode="async", buffer_size=1, max_versions=5)
    channel = grpc.insecure_channel(srv.address)
    stub = pb_grpc.AggregatorStub(channel)
    real, impostor = NodeKey.generate(), NodeKey.generate()
    t = GrpcTransport(srv.address, timeout_s=5)
    try:
        session = t.join_as(real, DeviceProfile())[0].session
        with pytest.raises(grpc.RpcError) as err:  # no proof at all
            stub.Join(pb.JoinRequest(client_id=real.client_id), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        nonce = stub.Challenge(pb.ChallengeRequest(), timeout=5).nonce
        proof = impostor.join_proof(nonce)
        with pytest.raises(grpc.RpcError) as err:  # another key for the real client's id
            stub.Join(pb.JoinRequest(client_id=real.client_id, public_key=proof.public_key,
                                     nonce=proof.nonce, signature=proof.signature), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not the id of this public key" in err.value.details()
        payload = np.ones(4, "<f4").tobytes()
        header = UpdateHeader(session=session, update_id="u1", base_version=0, num_examples=1,
                              codec="dense-f32", payload_bytes=len(payload),
                              spec_fingerprint=SPEC.fingerprint())
        with pytest.raises(RemoteError) as exc:  # unsigned
            t.push(header, payload)
        assert exc.value.status == "PERMISSION_DENIED"
        good = real.sign_update(header, payload_digest(payload))
        with pytest.raises(RemoteError) as exc:  # signed, then modified in flight
            t.push(good, np.full(4, 7, "<f4").tobytes())
        assert exc.value.status == "PERMISSION_DENIED"
        assert srv.call(lambda: srv.core.version) == 0
        assert t.push(good, payload).duplicate is False  # the real session carries on
        assert srv.call(lambda: srv.core.version) == 1
    finally:
        t.close()
        channel.close()


def test_plaintext_is_refused_off_loopback_unless_insecure(pki) -> None:
    with pytest.raises(ValueError, match="refusing to serve plaintext on 0.0.0.0"):
        ServerConfig.from_flat(address="0.0.0.0:0")
    assert ServerConfig.from_flat(address="0.0.0.0:0", insecure=True).security.insecure
    assert ServerConfig.from_flat(address="0.0.0.0:0", tls_cert="c",
                                  tls_key="k").security.tls_cert
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        ServerConfig.from_flat(tls_cert="c")
    with pytest.raises(ValueError, match="refusing to talk plaintext to 10.1.2.3"):
        GrpcTransport("10.1.2.3:50051")
    GrpcTransport("10.1.2.3:50051", insecure=True).close()
    with pytest.raises(TlsError, match="does not match"):
        GrpcTransport("127.0.0.1:1", tls=ClientTls(str(pki["ca"]), str(pki["client_cert"]),
                                                     str(pki["evil_key"])))
    with pytest.raises(TlsError, match="cannot read CA certificate"):
        GrpcTransport("127.0.0.1:1", tls=ClientTls(str(pki["root"] / "nope.crt")))


@pytest.mark.slow
def test_payloads_hashed_in_a_worker_process_are_verified_before_they_count(serve) -> None:
    """workers=1: the payload's SHA-256 is computed by the aggregation function in a worker
    process (not on the event loop) and the signature is checked against it."""
    srv = serve(min_clients=1, mode="async", buffer_size=1, max_versions=5, workers=1)
    assert not srv.server.tier.inline
    key = NodeKey.generate()
    t = GrpcTransport(srv.address, timeout_s=60)
    try:
        session = t.join_as(key, DeviceProfile())[0].session
        payload = np.full(4, 2.0, "<f4").tobytes()
        header = key.sign_update(UpdateHeader(session=session, update_id="w1", base_version=0,
                                              num_examples=1, codec="dense-f32",
                                              payload_bytes=len(payload),
                                              spec_fingerprint=SPEC.fingerprint()),
                                 payload_digest(payload))
        with pytest.raises(RemoteError) as exc:
            t.push(header, np.full(4, 5.0, "<f4").tobytes())
        assert exc.value.status == "PERMISSION_DENIED"
        assert t.push(header, payload).duplicate is False
        assert srv.call(lambda: srv.server.tier.stats()["decoded"]) == 2  # both in the worker
        np.testing.assert_allclose(srv.call(lambda: srv.core.params.copy()), [2.0] * 4)
    finally:
        t.close()
