"""A client's first contact over real gRPC on loopback: a TLS mismatch is named with the flag
that fixes it and ends the client at once; a server never reached ends it after
``give_up_unreached_s``; a server reached once is retried for ``RetryPolicy.give_up_after_s``."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from murmura.client import ClientRuntime, FunctionTrainer, GrpcTransport, RemoteError, RetryPolicy
from murmura.client.transport import TlsMismatch
from murmura.protocols.tls import ClientTls, spoken_protocol

pytestmark = pytest.mark.integration





@pytest.fixture
def dead_address() -> Iterator[str]:
    """A loopback port that is bound (so no one else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def runtime(transport: GrpcTransport, **kwargs: object) -> ClientRuntime:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    return ClientRuntime(transport, FunctionTrainer(model, lambda m, s, seed: {"num_examples": 1}),
                         wait_s=0.2, **kwargs)  # type: ignore[arg-type]


def fails_within(rt: ClientRuntime, seconds: float) -> tuple[RemoteError, float]:
    t0 = time.monotonic()
    try:
        with pytest.raises(RemoteError) as err:
            rt.run()
    finally:
        rt.transport.close()
    elapsed = time.monotonic() - t0
    assert elapsed < seconds, elapsed
    return err.value, elapsed


def test_the_probe_tells_tls_from_plaintext_and_nothing_listening(serve_tiny, pki,
                                                                 dead_address) -> None:
    assert spoken_protocol(serve_tiny(tls_cert=str(pki["cert"]), tls_key=str(pki["key"])).address) \
        == "tls"
    assert spoken_protocol(serve_tiny().address) == "plaintext"
    assert spoken_protocol(dead_address) == "refused"


def test_a_plaintext_client_of_a_tls_server_is_told_to_pass_tls_ca_at_once(serve_tiny, pki) -> None:
    srv = serve_tiny(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]))
    rt = runtime(GrpcTransport(srv.address, connect_timeout_s=1.0),
                 retry=RetryPolicy(give_up_after_s=300.0))  # retrying would take minutes
    error, _ = fails_within(rt, 10.0)
    assert isinstance(error, TlsMismatch) and not error.retryable
    assert f"the server at {srv.address} speaks TLS; pass --tls-ca" in error.message
    assert rt.stats.retries == 0


def test_a_tls_client_of_a_plaintext_server_is_told_to_drop_tls_ca_at_once(serve_tiny, pki) -> None:
    srv = serve_tiny()
    rt = runtime(GrpcTransport(srv.address, tls=ClientTls(str(pki["ca"])), connect_timeout_s=1.0),
                 retry=RetryPolicy(give_up_after_s=300.0))
    error, _ = fails_within(rt, 10.0)
    assert isinstance(error, TlsMismatch) and not error.retryable
    assert f"the server at {srv.address} is plaintext; drop --tls-ca" in error.message
    assert "--insecure" in error.message
    assert rt.stats.retries == 0


def test_a_client_that_never_reached_its_server_gives_up_after_the_unreached_limit(
        dead_address: str) -> None:
    rt = runtime(GrpcTransport(dead_address, connect_timeout_s=0.3),
                 retry=RetryPolicy(initial_s=0.05, max_s=0.2, give_up_after_s=300.0),
                 give_up_unreached_s=1.0)
    error, elapsed = fails_within(rt, 8.0)
    assert elapsed >= 1.0
    assert error.status == "UNAVAILABLE"
    assert f"cannot reach the aggregator at {dead_address} (connection refused)" in error.message
    assert "gave up after 1 s without ever reaching it (--give-up-unreached-s)" in error.message
    assert rt.stats.retries >= 1


def test_a_client_that_was_connected_keeps_retrying_as_its_retry_policy_says(serve_tiny) -> None:
    srv = serve_tiny()
    transport = GrpcTransport(srv.address, timeout_s=0.3, connect_timeout_s=2.0)
    transport.connect()
    assert transport.connected
    srv.stop(grace=None)  # the server goes away after the first contact
    rt = runtime(transport, retry=RetryPolicy(initial_s=0.05, max_s=0.2, give_up_after_s=2.0),
                 give_up_unreached_s=0.2)
    error, elapsed = fails_within(rt, 10.0)
    assert elapsed >= 1.8  # the policy's 2 s, not the never-connected 0.2 s
    assert error.retryable and "without ever reaching" not in error.message
    assert rt.stats.retries >= 3
