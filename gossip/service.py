"""The Peer gRPC servicer: decode, call the :class:`PeerHandler`, encode.

Refusals are the handler's typed errors (:mod:`murmura.gossip.errors`), mapped to a
``grpc.StatusCode`` here in one place. A push's header is checked before a single payload
byte is kept; the stream must then carry exactly the announced bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc

from murmura.gossip.errors import GossipError, InvalidArgument
from murmura.gossip.transport import PeerHandler
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import serde

log = logging.getLogger(__name__)

__all__ = ["PeerServicer"]


def _abort(context: grpc.ServicerContext, exc: GossipError) -> None:
    context.abort(getattr(grpc.StatusCode, exc.status, grpc.StatusCode.UNKNOWN), str(exc))


def _parsed(request: Any) -> Any:
    """``request``, unless its bytes did not parse (see :func:`serde.tolerant`)."""
    if isinstance(request, serde.Malformed):
        raise InvalidArgument(f"{request.what} does not parse")
    return request


class PeerServicer:
    def __init__(self, handler: PeerHandler, *, chunk_bytes: int = serde.CHUNK_BYTES) -> None:
        self.handler = handler
        self.chunk_bytes = chunk_bytes

    def register(self, server: grpc.Server) -> None:
        tolerant = serde.tolerant  # undecodable bytes: INVALID_ARGUMENT, not a traceback
        handlers = {
            "Exchange": grpc.unary_unary_rpc_method_handler(
                self.Exchange,
                request_deserializer=tolerant(pb.PeerExchange.FromString, "PeerExchange"),
                response_serializer=pb.PeerExchange.SerializeToString),
            "PushModel": grpc.stream_unary_rpc_method_handler(
                self.PushModel,
                request_deserializer=tolerant(serde.deserialize_peer_item, "a PeerChunk"),
                response_serializer=pb.PeerPushReply.SerializeToString),
            "PullModel": grpc.unary_stream_rpc_method_handler(
                self.PullModel,
                request_deserializer=tolerant(pb.PeerPullRequest.FromString, "PeerPullRequest"),
                response_serializer=serde.serialize_model_item),
            "Health": grpc.unary_unary_rpc_method_handler(
                self.Health,
                request_deserializer=tolerant(pb.PeerHealthRequest.FromString,
                                              "PeerHealthRequest"),
                response_serializer=pb.PeerHealthReply.SerializeToString),
            "PullStepLogs": grpc.unary_unary_rpc_method_handler(
                self.PullStepLogs,
                request_deserializer=tolerant(pb.PeerPullRequest.FromString, "PeerPullRequest"),
                response_serializer=pb.PeerStepLogs.SerializeToString),
            "Goodbye": grpc.unary_unary_rpc_method_handler(
                self.Goodbye,
                request_deserializer=tolerant(pb.PeerExchange.FromString, "PeerExchange"),
                response_serializer=pb.PeerPushReply.SerializeToString),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("murmura.v1.Peer", handlers),))

    def Exchange(self, request: pb.PeerExchange, context: grpc.ServicerContext) -> Any:
        try:
            _parsed(request)
            if len(request.peers) > 1024 or len(request.history) > 1024:
                raise InvalidArgument(f"an exchange carries at most 1024 peers and 1024 "
                                      f"history records, got {len(request.peers)} and "
                                      f"{len(request.history)}")
            me, peers, history = self.handler.on_exchange(
                serde.peer_info_from_proto(request.sender),
                [serde.peer_info_from_proto(p) for p in request.peers],
                request.spec_fingerprint, request.signature,
                serde.history_from_proto(request.history))
        except GossipError as exc:
            _abort(context, exc)
        return pb.PeerExchange(sender=serde.peer_info_to_proto(me),
                               peers=[serde.peer_info_to_proto(p) for p in peers],
                               history=serde.history_to_proto(history))

    def PushModel(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        try:
            first = _parsed(next(request_iterator, None))
            if first is None or isinstance(first, memoryview) or \
                    first.WhichOneof("kind") != "header":
                raise InvalidArgument("a model push must begin with a PeerModelHeader chunk")
            header = serde.peer_model_header_from_proto(first.header)
            limit = self.handler.check_header(header)
            if not 0 <= header.payload_bytes <= limit:
                raise InvalidArgument(f"payload of {header.payload_bytes} bytes announced; "
                                      f"at most {limit} accepted")
            buf = bytearray(header.payload_bytes)
            received = 0
            for item in request_iterator:
                _parsed(item)
                if not isinstance(item, memoryview):
                    if item.WhichOneof("kind") != "data":
                        raise InvalidArgument("a second header inside a model push")
                    item = memoryview(item.data)
                end = received + len(item)
                if end > header.payload_bytes:
                    raise InvalidArgument(f"the push carries more than the "
                                          f"{header.payload_bytes} bytes announced")
                buf[received:end] = item
                received = end
            if received != header.payload_bytes:
                raise InvalidArgument(f"the push carried {received} of the "
                                      f"{header.payload_bytes} bytes announced")
            taken, round_ = self.handler.on_model(header, memoryview(buf))
        except GossipError as exc:
            _abort(context, exc)
        return pb.PeerPushReply(duplicate=not taken, round=round_)

    def PullModel(self, request: pb.PeerPullRequest, context: grpc.ServicerContext) -> Any:
        try:
            _parsed(request)
            round_, spec, model = self.handler.on_pull(request.peer_id, request.snapshot)
        except GossipError as exc:
            _abort(context, exc)
        yield from serde.iter_model_items(round_, spec, "dense-f32", model.tobytes(),
                                          self.chunk_bytes)

    def PullStepLogs(self, request: pb.PeerPullRequest, context: grpc.ServicerContext) -> Any:
        try:
            _parsed(request)
            round_, sha, rounds = self.handler.on_step_logs(request.peer_id)
        except GossipError as exc:
            _abort(context, exc)
        return serde.step_logs_to_proto(round_, sha, rounds)

    def Health(self, request: pb.PeerHealthRequest, context: grpc.ServicerContext) -> Any:
        try:
            _parsed(request)
        except GossipError as exc:
            _abort(context, exc)
        h = self.handler.on_health()
        return pb.PeerHealthReply(peer_id=h.peer_id, round=h.round, view_size=h.view_size,
                                  training=h.training)

    def Goodbye(self, request: pb.PeerExchange, context: grpc.ServicerContext) -> Any:
        try:
            _parsed(request)
            self.handler.on_goodbye(serde.peer_info_from_proto(request.sender),
                                    request.signature)
        except GossipError as exc:
            _abort(context, exc)
        return pb.PeerPushReply()


