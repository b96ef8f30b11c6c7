"""How a client reaches the aggregator: one small interface, a gRPC implementation.

The simulation supplies an in-memory implementation of the same interface, so the client
runtime runs unchanged over the network and inside a simulated federation.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from murmura.protocols import (
    PROTOCOL_VERSION,
    DeviceProfile,
    FlatVector,
    JoinProof,
    JoinResult,
    ModelSpec,
    PushResult,
    Task,
    UpdateHeader,
    serde,
)
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.protocols.identity import NodeKey
from murmura.protocols.pool import POOL_SCALARS_CODEC
from murmura.protocols.tls import (
    ClientTls,
    channel_credentials,
    handshake_failure,
    is_loopback,
    spoken_protocol,
)

if TYPE_CHECKING:
    from murmura.client.secagg import SecAggLink

log = logging.getLogger(__name__)

#: How long a first contact waits for an answer before it fails with UNAVAILABLE, naming the
#: address; the retry policy then tries again or gives up.
CONNECT_TIMEOUT_S = 3.0
#: After the receivers' port failed (nothing answered, or no connection within the connect
#: timeout: a firewall that drops packets), pushes go to the aggregator for this long before
#: the port is tried again, so a blocked port costs one wait, not one per push.
PUSH_PORT_RETRY_S = 60.0

#: Statuses worth retrying after a pause: the server is away, overloaded or restarting.
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED"})


#: Trailing metadata of a back-pressure refusal: milliseconds to wait before retrying.
RETRY_AFTER_KEY = "murmura-retry-after-ms"


class RemoteError(Exception):
    """The aggregator refused a request or could not be reached; ``status`` names why.

    ``retry_after_s`` is set when the server said the refusal is temporary (back-pressure:
    RESOURCE_EXHAUSTED with a retry hint), which makes it retryable after that pause.
    """

    def __init__(self, status: str, message: str, *, retry_after_s: float | None = None
                 ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE or self.retry_after_s is not None


class TlsMismatch(RemoteError):
    """The client and the aggregator disagree on TLS: no retry can succeed, a flag must
    change, so the message names it (FAILED_PRECONDITION: not retryable)."""

    def __init__(self, message: str) -> None:
        super().__init__("FAILED_PRECONDITION", message)


class Transport(ABC):
    @abstractmethod
    def join(self, client_id: str, profile: DeviceProfile, token: str = "",
             proof: JoinProof | None = None) -> tuple[JoinResult, ModelSpec]: ...

    def challenge(self) -> bytes:
        """A single-use nonce from the aggregator, for a Join proof."""
        raise NotImplementedError(f"{type(self).__name__} cannot ask for a join challenge")

    def join_as(self, identity: NodeKey, profile: DeviceProfile, token: str = ""
                ) -> tuple[JoinResult, ModelSpec]:
        """Join under ``identity``'s client id, proving the key over a fresh challenge."""
        proof = identity.join_proof(self.challenge())
        return self.join(identity.client_id, profile, token, proof)

    @abstractmethod
    def task(self, session: str, wait_s: float) -> Task: ...

    @abstractmethod
    def pull(self, session: str) -> tuple[int, FlatVector]:
        """The current global version and a writable copy of its vector."""

    @abstractmethod
    def push(self, header: UpdateHeader, payload: bytes) -> PushResult: ...

    @abstractmethod
    def leave(self, session: str) -> None: ...

    def secagg_link(self) -> SecAggLink:
        """The SecureAggregation steps over this transport (docs/privacy.md)."""
        raise RemoteError("UNIMPLEMENTED", f"{type(self).__name__} has no secure aggregation")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    @property
    def connected(self) -> bool:
        """Whether the aggregator has answered once: until then the runtime gives up after
        its own, shorter limit (a wrong address should fail in seconds, not minutes). An
        in-memory transport is always connected."""
        return True

    def pull_pool_base(self, session: str) -> tuple[int, FlatVector]:
        """Seed-pool runs: ``(base_version, base)``, the model the pool's scalars apply to."""
        raise NotImplementedError(f"{type(self).__name__} cannot pull a seed pool's base")

    def pull_pool_scalars(self, session: str) -> tuple[int, int, FlatVector]:
        """Seed-pool runs: ``(version, base_version, scalars)``, the K cumulative scalars."""
        raise NotImplementedError(f"{type(self).__name__} cannot pull a seed pool's scalars")

    @property
    def bytes_up(self) -> int:
        return 0

    @property
    def bytes_down(self) -> int:
        return 0


class GrpcTransport(Transport):
    """The aggregator over gRPC; every call has a deadline.

    ``tls`` names the CA that signed the server's certificate (and this client's certificate
    for mutual TLS). Without it the channel is plaintext, which is refused for a non-loopback
    address unless ``insecure`` is set.
    """

    def __init__(self, address: str, *, timeout_s: float = 60.0,
                 chunk_bytes: int = serde.CHUNK_BYTES, tls: ClientTls | None = None,
                 insecure: bool = False, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.tls = tls
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connected = False  # the aggregator has answered once
        self._warned = False
        self.chunk_bytes = chunk_bytes
        options = [
            ("grpc.max_receive_message_length", 4 * chunk_bytes + (1 << 16)),
            ("grpc.max_send_message_length", 4 * chunk_bytes + (1 << 16)),
            # reconnect within seconds of a restarted server, not gRPC's 2-minute backoff cap
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        if tls is not None:
            self._channel = grpc.secure_channel(address, channel_credentials(tls), options)
        elif insecure or is_loopback(address):
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            raise ValueError(f"refusing to talk plaintext to {address[:60]}: give --tls-ca "
                             f"(see docs/security.md) or --insecure")
        self._stub = pb_grpc.AggregatorStub(self._channel)
        # Push and Pull frame payload chunks without protobuf copies (serde.frame_data); the
        # bytes on the wire are exactly the proto's.
        self._push = self._channel.stream_unary(
            "/murmura.v1.Aggregator/Push", request_serializer=serde.serialize_update_item,
            response_deserializer=pb.PushReply.FromString)
        self._options = options
        #: Set from Join when the server runs receiver processes: pushes go to that port.
        self._push_channel: grpc.Channel | None = None
        self._push_remote: Any = None
        self._push_port_retry_at = 0.0
        self.push_address = ""
        self._pull = self._channel.unary_stream(
            "/murmura.v1.Aggregator/Pull", request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=serde.deserialize_model_item)
        self._bytes_up = self._bytes_down = 0

    @staticmethod
    def _wrap(exc: grpc.RpcError) -> RemoteError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        retry_after = None
        trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        for key, value in trailing or ():
            if key == RETRY_AFTER_KEY:
                try:
                    retry_after = min(max(int(value) / 1000.0, 0.0), 60.0)
                except ValueError:
                    pass
        return RemoteError(code.name if code else "UNKNOWN", details or "",
                           retry_after_s=retry_after)

    def connect(self) -> None:
        """Make sure the aggregator answers: a no-op once it has, else one Challenge call.

        A first contact waits at most ``connect_timeout_s`` for an answer (later calls wait
        up to the call deadline, ``timeout_s``, for a restarted server); with nothing
        listening it fails with a retryable :class:`RemoteError` (``UNAVAILABLE``) that names
        the address, logs a warning with a hint the first time, and the runtime's retry
        policy decides when to give up. A server that speaks the other protocol (TLS against
        plaintext) fails it with :class:`TlsMismatch`, which no retry can cure.
        """
        if not self._connected:
            self.challenge()

    @property
    def connected(self) -> bool:
        return self._connected

    def _diagnose(self) -> TlsMismatch | str | None:
        """Why a first contact got no answer: a TLS mismatch, named with the flag that fixes
        it; ``"connection refused"`` when nothing listens; None when that cannot be told."""
        spoken = spoken_protocol(self.address, timeout_s=min(self.connect_timeout_s, 2.0))
        if spoken == "refused":
            return "connection refused"
        where = self.address[:80]
        if spoken == "tls" and self.tls is None:
            return TlsMismatch(f"the server at {where} speaks TLS; pass --tls-ca CA.crt, the "
                               f"CA certificate that signed the server's certificate "
                               f"(docs/security.md)")
        if spoken == "plaintext" and self.tls is not None:
            return TlsMismatch(f"the server at {where} is plaintext; drop --tls-ca (and "
                               f"--tls-cert/--tls-key; off loopback pass --insecure), or "
                               f"serve with --tls-cert/--tls-key")
        if spoken == "tls" and self.tls is not None:  # both speak TLS: the handshake failed
            why = handshake_failure(self.address, self.tls,
                                    timeout_s=min(self.connect_timeout_s, 2.0))
            if why is not None:
                return TlsMismatch(why)
        return None

    def _unreachable(self, exc: grpc.RpcError) -> RemoteError:
        """A first contact that failed: UNAVAILABLE naming the address, or what it said."""
        error = self._wrap(exc)
        if error.status not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            return error  # something answered: its refusal says what is wrong
        details = error.message.lower()
        found = None if "refused" in details else self._diagnose()
        if isinstance(found, TlsMismatch):
            return found
        reason = ("connection refused" if "refused" in details
                  else found if found is not None
                  else f"no answer within {self.connect_timeout_s:g} s"
                  if error.status == "DEADLINE_EXCEEDED" else error.message[:80])
        message = (f"cannot reach the aggregator at {self.address[:80]} ({reason}): is "
                   f"`murmura server` running there? check the address, the port and TLS "
                   f"settings")
        if not self._warned:
            self._warned = True
            log.warning(message)
        return RemoteError("UNAVAILABLE", message)

    def challenge(self) -> bytes:
        try:
            if self._connected:
                reply = self._stub.Challenge(pb.ChallengeRequest(), timeout=self.timeout_s,
                                             wait_for_ready=True)
            else:  # a first contact waits connect_timeout_s at most (see connect)
                reply = self._stub.Challenge(pb.ChallengeRequest(),
                                             timeout=self.connect_timeout_s,
                                             wait_for_ready=True)
        except grpc.RpcError as exc:
            raise (self._wrap(exc) if self._connected else self._unreachable(exc)) from None
        if not self._connected and self._warned:
            log.info("connected to the aggregator at %s", self.address[:80])
        self._connected = True
        return bytes(reply.nonce)

    def join(self, client_id: str, profile: DeviceProfile, token: str = "",
             proof: JoinProof | None = None) -> tuple[JoinResult, ModelSpec]:
        req = pb.JoinRequest(client_id=client_id, profile=serde.profile_to_proto(profile),
                             token=token, protocol_version=PROTOCOL_VERSION)
        if proof is not None:
            req.public_key, req.nonce, req.signature = (proof.public_key, proof.nonce,
                                                        proof.signature)
        self.connect()
        try:
            reply = self._stub.Join(req, timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        result, spec = serde.join_result_from_proto(reply)
        self._use_push_port(result.push_port)
        return result, spec

    def _use_push_port(self, port: int) -> None:
        """Push to the receivers' ``port`` on the aggregator's host (0: to the aggregator)."""
        address = f"{self.address.rsplit(':', 1)[0]}:{port}" if port else ""
        if address == self.push_address:
            return
        if self._push_channel is not None:
            self._push_channel.close()
        self._push_channel, self._push_remote, self.push_address = None, None, address
        self._push_port_retry_at = 0.0
        if not address:
            return
        # A connection attempt (TCP and the TLS/HTTP2 handshake) that takes longer than the
        # connect timeout fails the push over to the aggregator, instead of gRPC's 20 s.
        options = [*self._options,
                   ("grpc.min_reconnect_backoff_ms", int(1000 * self.connect_timeout_s))]
        if self.tls is not None:
            self._push_channel = grpc.secure_channel(address, channel_credentials(self.tls),
                                                     options)
        else:  # the aggregator's own address passed the plaintext check; same host
            self._push_channel = grpc.insecure_channel(address, options=options)
        self._push_remote = self._push_channel.stream_unary(
            "/murmura.v1.Aggregator/Push", request_serializer=serde.serialize_update_item,
            response_deserializer=pb.PushReply.FromString)

    def task(self, session: str, wait_s: float) -> Task:
        try:
            reply = self._stub.GetTask(pb.TaskRequest(session=session, wait_s=wait_s),
                                       timeout=wait_s + self.timeout_s)
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        return serde.task_from_proto(reply)

    def _pull_vector(self, request: pb.PullRequest, codec: str
                     ) -> tuple[pb.ModelHeader, FlatVector]:
        """One Pull stream into a fresh float32 vector, with its header."""
        try:
            stream = self._pull(request, timeout=self.timeout_s)
            header = None
            out = np.empty(0, dtype="<f4")
            view = memoryview(b"")
            received = wire = 0
            for item in stream:
                if not isinstance(item, memoryview) and item.WhichOneof("kind") == "header":
                    wire += item.ByteSize()
                    header = item.header
                    if header.payload_bytes % 4:
                        raise RemoteError("DATA_LOSS",
                                          f"a float32 vector of {header.payload_bytes} bytes")
                    # writable, filled as chunks arrive (one copy, overlapping the transfer)
                    out = np.empty(header.payload_bytes // 4, dtype="<f4")
                    view = out.data.cast("B")
                    continue
                if header is None:
                    raise RemoteError("DATA_LOSS", "model stream began without a header")
                data = item if isinstance(item, memoryview) else memoryview(item.data)
                end = received + len(data)
                if end > header.payload_bytes:
                    raise RemoteError("DATA_LOSS", "model stream is longer than announced")
                view[received:end] = data
                received = end
                wire += serde.data_chunk_wire_bytes(len(data))
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        if header is None or received != header.payload_bytes:
            raise RemoteError("DATA_LOSS", "model stream ended early")
        self._bytes_down += wire
        if header.codec != codec:
            raise RemoteError("UNIMPLEMENTED", f"expected codec {codec!r}, the pull arrived in "
                                               f"{header.codec!r}")
        return header, out.astype(np.float32, copy=False)

    def pull(self, session: str) -> tuple[int, FlatVector]:
        header, params = self._pull_vector(pb.PullRequest(session=session), "dense-f32")
        return header.version, params

    def pull_pool_base(self, session: str) -> tuple[int, FlatVector]:
        header, base = self._pull_vector(
            pb.PullRequest(session=session, kind=pb.PullRequest.POOL_BASE), "dense-f32")
        return header.base_version, base

    def pull_pool_scalars(self, session: str) -> tuple[int, int, FlatVector]:
        header, scalars = self._pull_vector(
            pb.PullRequest(session=session, kind=pb.PullRequest.POOL_SCALARS),
            POOL_SCALARS_CODEC)
        return header.version, header.base_version, scalars

    def push(self, header: UpdateHeader, payload: bytes) -> PushResult:
        items = list(serde.iter_update_items(header, payload, self.chunk_bytes))
        reply = None
        if self._receivers_reachable():
            try:
                reply = self._push_remote(iter(items), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                error = self._wrap(exc)
                if error.status not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    raise error from None
                # no receiver answered (restarting, or the port is blocked): the aggregator
                # serves Push too, and a retried update that was taken is a duplicate there
                self._avoid_receivers(error.status)
        if reply is None:
            try:
                reply = self._push(iter(items), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                raise self._wrap(exc) from None
        self._bytes_up += sum(serde.data_chunk_wire_bytes(len(c)) if isinstance(c, memoryview)
                              else c.ByteSize() for c in items)
        return serde.push_result_from_proto(reply)

    def _receivers_reachable(self) -> bool:
        """Whether to push to the receivers' port: it was announced and has not failed in
        the last :data:`PUSH_PORT_RETRY_S`."""
        return self._push_channel is not None \
            and time.monotonic() >= self._push_port_retry_at

    def _avoid_receivers(self, why: str) -> None:
        self._push_port_retry_at = time.monotonic() + PUSH_PORT_RETRY_S
        log.info("push to the receivers at %s failed (%s); pushing to %s for the next "
                 "%g s", self.push_address[:80], why, self.address[:80], PUSH_PORT_RETRY_S)

    def secagg_link(self) -> SecAggLink:
        from murmura.client.secagg import SecAggLink

        return SecAggLink(self._channel, timeout_s=self.timeout_s, chunk_bytes=self.chunk_bytes)

    def leave(self, session: str) -> None:
        try:
            self._stub.Leave(pb.LeaveRequest(session=session), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None

    def close(self) -> None:
        if self._push_channel is not None:
            self._push_channel.close()
        self._channel.close()

    @property
    def bytes_up(self) -> int:
        return self._bytes_up

    @property
    def bytes_down(self) -> int:
        """Wire bytes of every model, base and scalar pull so far."""
        return self._bytes_down
