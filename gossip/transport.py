"""How a peer reaches other peers: one small interface, a gRPC implementation.

The interface covers the calls a peer makes (shuffle views, push a model, pull a model,
health, goodbye) and serving its own :class:`PeerHandler`. Every call has a deadline; failures
come back as :class:`~murmura.client.RemoteError` with the gRPC status name, as for clients.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from murmura.client.transport import RemoteError
from murmura.gossip.journal import RoundLogs
from murmura.protocols import FlatVector, ModelSpec, PeerInfo, PeerModelHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc

__all__ = ["GrpcPeerTransport", "Health", "HistoryRecord", "PeerHandler", "PeerTransport"]

#: (peer id, round, sketch): a sketch of a model some peer received (Sybil history gossip).
HistoryRecord = tuple[str, int, Any]


@dataclass(frozen=True)
class Health:
    peer_id: str
    round: int
    view_size: int
    training: bool


class PeerHandler(ABC):
    """What a peer answers; the servicer decodes, calls one of these, encodes."""

    @abstractmethod
    def on_exchange(self, sender: PeerInfo, peers: Sequence[PeerInfo], fingerprint: str,
                    signature: bytes, history: Sequence[HistoryRecord] = ()
                    ) -> tuple[PeerInfo, list[PeerInfo], list[HistoryRecord]]: ...

    @abstractmethod
    def on_model(self, header: PeerModelHeader, payload: bytes | memoryview
                 ) -> tuple[bool, int]: ...

    @abstractmethod
    def check_header(self, header: PeerModelHeader) -> int:
        """Refuse a push by its header; return the largest payload accepted."""

    @abstractmethod
    def on_pull(self, peer_id: str, snapshot: bool = False
                ) -> tuple[int, ModelSpec, FlatVector]:
        """(round, spec, model): the current model, or the seed-mode snapshot."""

    @abstractmethod
    def on_step_logs(self, peer_id: str) -> tuple[int, bytes, list[RoundLogs]]:
        """Seed mode: (snapshot round, snapshot SHA-256, the rounds of step logs since)."""

    @abstractmethod
    def on_health(self) -> Health: ...

    @abstractmethod
    def on_goodbye(self, sender: PeerInfo, signature: bytes = b"") -> None: ...


class PeerTransport(ABC):
    @abstractmethod
    def serve(self, handler: PeerHandler) -> str:
        """Start answering peers with ``handler``; return the address actually bound."""

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def exchange(self, address: str, me: PeerInfo, peers: Sequence[PeerInfo], fingerprint: str,
                 history: Sequence[HistoryRecord] = (), *, signature: bytes = b""
                 ) -> tuple[PeerInfo, list[PeerInfo], list[HistoryRecord]]:
        """A view shuffle: (the partner's entry, entries of its view, its history records)."""

    @abstractmethod
    def push_model(self, address: str, header: PeerModelHeader, payload: bytes) -> bool:
        """Send a model; True when the receiver took it (False: a duplicate)."""

    @abstractmethod
    def pull_model(self, address: str, peer_id: str, *, snapshot: bool = False
                   ) -> tuple[int, FlatVector]: ...

    @abstractmethod
    def pull_step_logs(self, address: str, peer_id: str
                       ) -> tuple[int, bytes, list[RoundLogs]]:
        """Seed mode: a peer's snapshot round and digest and its step logs since."""

    @abstractmethod
    def health(self, address: str) -> Health: ...

    @abstractmethod
    def goodbye(self, address: str, me: PeerInfo, *, signature: bytes = b"") -> None: ...

    @property
    def bytes_sent(self) -> int:
        return 0


class GrpcPeerTransport(PeerTransport):
    """Peers over gRPC: a sync server (a thread pool, no event loop to block) and cached
    channels to other peers."""

    def __init__(self, listen: str = "127.0.0.1:0", *, timeout_s: float = 10.0,
                 chunk_bytes: int = serde.CHUNK_BYTES, max_workers: int = 8) -> None:
        self.listen, self.timeout_s, self.chunk_bytes = listen, timeout_s, chunk_bytes
        self.max_workers = max_workers
        self._server: grpc.Server | None = None
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PeerStub, object, object]] = {}
        self._lock = threading.Lock()
        self._bytes_sent = 0
        self.address = ""

    # -- serving

    def serve(self, handler: PeerHandler) -> str:
        from murmura.gossip.service import PeerServicer

        limit = 4 * self.chunk_bytes + (1 << 16)
        self._server = grpc.server(futures.ThreadPoolExecutor(self.max_workers), options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)])
        PeerServicer(handler, chunk_bytes=self.chunk_bytes).register(self._server)
        host = self.listen.rsplit(":", 1)[0]
        port = self._server.add_insecure_port(self.listen)
        if port == 0:
            raise OSError(f"could not bind {self.listen}")
        self._server.start()
        self.address = f"{host}:{port}"
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0).wait()  # let in-flight replies go out
            self._server = None
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel, *_ in channels:
            channel.close()

    # -- calling

    def _conn(self, address: str) -> tuple[pb_grpc.PeerStub, object, object]:
        with self._lock:
            entry = self._channels.get(address)
            if entry is None:
                limit = 4 * self.chunk_bytes + (1 << 16)
                channel = grpc.insecure_channel(address, options=[
                    ("grpc.max_receive_message_length", limit),
                    ("grpc.max_send_message_length", limit)])
                push = channel.stream_unary(
                    "/murmura.v1.Peer/PushModel", request_serializer=serde.serialize_peer_item,
                    response_deserializer=pb.PeerPushReply.FromString)
                pull = channel.unary_stream(
                    "/murmura.v1.Peer/PullModel",
                    request_serializer=pb.PeerPullRequest.SerializeToString,
                    response_deserializer=serde.deserialize_model_item)
                entry = (channel, pb_grpc.PeerStub(channel), push, pull)
                self._channels[address] = entry
            return entry[1], entry[2], entry[3]

    def forget(self, address: str) -> None:
        """Close the channel to a peer that is gone."""
        with self._lock:
            entry = self._channels.pop(address, None)
        if entry is not None:
            entry[0].close()

    @staticmethod
    def _wrap(exc: grpc.RpcError) -> RemoteError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return RemoteError(code.name if code else "UNKNOWN", details or "")

    def exchange(self, address: str, me: PeerInfo, peers: Sequence[PeerInfo], fingerprint: str,
                 history: Sequence[HistoryRecord] = (), *, signature: bytes = b""
                 ) -> tuple[PeerInfo, list[PeerInfo], list[HistoryRecord]]:
        stub, _, _ = self._conn(address)
        req = pb.PeerExchange(sender=serde.peer_info_to_proto(me),
                              peers=[serde.peer_info_to_proto(p) for p in peers],
                              spec_fingerprint=fingerprint, signature=signature,
                              history=serde.history_to_proto(history))
        try:
            reply = stub.Exchange(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        with self._lock:
            self._bytes_sent += req.ByteSize()
        return (serde.peer_info_from_proto(reply.sender),
                [serde.peer_info_from_proto(p) for p in reply.peers],
                serde.history_from_proto(reply.history))

    def push_model(self, address: str, header: PeerModelHeader, payload: bytes) -> bool:
        _, push, _ = self._conn(address)
        items = list(serde.iter_peer_items(header, payload, self.chunk_bytes))
        try:
            reply = push(iter(items), timeout=self.timeout_s)  # type: ignore[operator]
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        sent = items[0].ByteSize() + sum(  # type: ignore[union-attr]
            serde.data_chunk_wire_bytes(len(c)) for c in items[1:])  # type: ignore[arg-type]
        with self._lock:
            self._bytes_sent += sent
        return not reply.duplicate

    def pull_model(self, address: str, peer_id: str, *, snapshot: bool = False
                   ) -> tuple[int, FlatVector]:
        _, _, pull = self._conn(address)
        header, out, received = None, np.empty(0, dtype="<f4"), 0
        request = pb.PeerPullRequest(peer_id=peer_id, snapshot=snapshot)
        try:
            for item in pull(request, timeout=self.timeout_s):  # type: ignore[operator]
                if not isinstance(item, memoryview) and item.WhichOneof("kind") == "header":
                    header = item.header
                    if header.payload_bytes % 4 or header.codec != "dense-f32":
                        raise RemoteError("DATA_LOSS", "a model pull must be dense-f32")
                    out = np.empty(header.payload_bytes // 4, dtype="<f4")
                    continue
                if header is None:
                    raise RemoteError("DATA_LOSS", "model stream began without a header")
                data = item if isinstance(item, memoryview) else memoryview(item.data)
                end = received + len(data)
                if end > header.payload_bytes:
                    raise RemoteError("DATA_LOSS", "model stream is longer than announced")
                memoryview(out).cast("B")[received:end] = data
                received = end
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        if header is None or received != header.payload_bytes:
            raise RemoteError("DATA_LOSS", "model stream ended early")
        return int(header.version), out.astype(np.float32, copy=False)

    def pull_step_logs(self, address: str, peer_id: str
                       ) -> tuple[int, bytes, list[RoundLogs]]:
        stub, _, _ = self._conn(address)
        try:
            reply = stub.PullStepLogs(pb.PeerPullRequest(peer_id=peer_id),
                                      timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        return serde.step_logs_from_proto(reply)

    def health(self, address: str) -> Health:
        stub, _, _ = self._conn(address)
        try:
            r = stub.Health(pb.PeerHealthRequest(), timeout=min(self.timeout_s, 2.0))
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None
        return Health(r.peer_id, r.round, r.view_size, r.training)

    def goodbye(self, address: str, me: PeerInfo, *, signature: bytes = b"") -> None:
        stub, _, _ = self._conn(address)
        try:
            stub.Goodbye(pb.PeerExchange(sender=serde.peer_info_to_proto(me),
                                         signature=signature),
                         timeout=min(self.timeout_s, 2.0))
        except grpc.RpcError as exc:
            raise self._wrap(exc) from None

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent
