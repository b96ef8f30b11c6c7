"""The gRPC face of secure aggregation: decode each step, call the policy, encode the answer.

Every handler validates what only the wire can get wrong (parse failures, field sizes,
repeated entries) and leaves the rest to :class:`~murmura.server.secagg.SecAggRound`, whose
refusals carry their gRPC status. The masked input is a client stream of ``UpdateChunk``
(header, then payload chunks), the framing Push uses, on its own RPC: a masked vector is not
an update the server can decode or fold, so it must never enter Push's decode-and-fold
pipeline or its durable spool; it is parsed, range-checked and added to the round's sum on the
publisher thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NoReturn, cast

import grpc

from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import serde
from murmura.protocols.identity import payload_digest, signed_update_message, verify
from murmura.protocols.secagg.envelope import Y_BYTES
from murmura.protocols.serde import Malformed, tolerant
from murmura.server.core import AggregatorCore
from murmura.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unauthenticated,
)
from murmura.server.futures import wait_for_thread
from murmura.server.limits import check_number
from murmura.server.secagg import AdvertisedKeys, ClientView, SecAggRound
from murmura.server.secagg_policy import SecAggAsyncPolicy, SecAggPolicy
from murmura.server.service import HELD_POLL_RECHECK_S

SERVICE = "murmura.v1.SecureAggregation"
MAX_WAIT_S = 30.0
#: No cohort needs more entries than this in one request (a neighbourhood is O(log n)).
MAX_ENTRIES = 4096


class SecureAggregationServicer:
    """Handlers of the SecureAggregation service, on the core's event loop."""

    def __init__(self, core: AggregatorCore, *, chunk_bytes: int = serde.CHUNK_BYTES) -> None:
        self.core = core
        self.chunk_bytes = chunk_bytes
        self._event: asyncio.Event | None = None
        core.add_listener(self._notify)

    def _notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = asyncio.Event()

    def _changed_event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def _policy(self) -> SecAggPolicy | SecAggAsyncPolicy:
        policy = self.core.policy
        if not isinstance(policy, SecAggPolicy | SecAggAsyncPolicy):
            raise FailedPrecondition("this run does not use secure aggregation (the server was "
                                     "started without --secure-aggregation)",
                                     reason="secure aggregation off")
        return policy

    async def _abort(self, context: grpc.aio.ServicerContext, exc: ServiceError) -> NoReturn:
        self.core.count_refusal(exc)
        await context.abort(grpc.StatusCode[exc.status], exc.message)
        raise exc  # not reached: context.abort raises

    @staticmethod
    def _parsed(request: object) -> None:
        if isinstance(request, Malformed):
            raise InvalidArgument(f"{request.what} does not parse")

    async def AdvertiseKeys(self, request: pb.SecAggKeys,
                            context: grpc.aio.ServicerContext) -> pb.SecAggAck:
        try:
            self._parsed(request)
            policy = self._policy()
            rec = self.core.client_for(request.session)
            if len(request.signature) > 128:
                raise InvalidArgument("signature too long")
            policy.advertise(rec, request.round, AdvertisedKeys(
                bytes(request.mask_public_key), bytes(request.enc_public_key),
                bytes(request.self_commitment), signature=bytes(request.signature)))
        except ServiceError as exc:
            await self._abort(context, exc)
        return pb.SecAggAck(round=request.round)

    async def ShareKeys(self, request: pb.SecAggShares,
                        context: grpc.aio.ServicerContext) -> pb.SecAggAck:
        try:
            self._parsed(request)
            policy = self._policy()
            rec = self.core.client_for(request.session)
            if len(request.shares) > MAX_ENTRIES:
                raise InvalidArgument(f"{len(request.shares)} envelopes; at most {MAX_ENTRIES}")
            envelopes = {c.peer: bytes(c.ciphertext) for c in request.shares}
            if len(envelopes) != len(request.shares):
                raise InvalidArgument("two envelopes for one neighbour")
            policy.share(rec, request.round, envelopes)
        except ServiceError as exc:
            await self._abort(context, exc)
        return pb.SecAggAck(round=request.round)

    async def Unmask(self, request: pb.SecAggUnmask,
                     context: grpc.aio.ServicerContext) -> pb.SecAggAck:
        try:
            self._parsed(request)
            policy = self._policy()
            rec = self.core.client_for(request.session)
            if len(request.shares) > MAX_ENTRIES:
                raise InvalidArgument(f"{len(request.shares)} shares; at most {MAX_ENTRIES}")
            shares: dict[tuple[int, str], int] = {}
            for s in request.shares:
                if len(s.y) > Y_BYTES:
                    raise InvalidArgument(f"a share value has at most {Y_BYTES} bytes")
                key = (s.owner, "key" if s.key else "self")
                if key in shares:
                    raise InvalidArgument(f"two {key[1]} shares of index {s.owner}")
                shares[key] = int.from_bytes(s.y, "big")
            policy.respond(rec, request.round, shares)
        except ServiceError as exc:
            await self._abort(context, exc)
        return pb.SecAggAck(round=request.round)

    async def MaskedInput(self, request_iterator: AsyncIterator[pb.UpdateChunk | memoryview],
                          context: grpc.aio.ServicerContext) -> pb.SecAggAck:
        core = self.core
        round_id = 0
        started: tuple[SecAggPolicy | SecAggAsyncPolicy, SecAggRound, int] | None = None
        try:
            header = None
            buf = bytearray()
            received = 0
            async for item in request_iterator:
                self._parsed(item)
                kind = "data" if isinstance(item, memoryview) else item.WhichOneof("kind")
                if header is None:
                    if kind != "header" or isinstance(item, memoryview):
                        raise InvalidArgument("the first chunk of a masked input is its header")
                    core.traffic.bytes_up += item.ByteSize()
                    header = serde.update_header_from_proto(item.header)
                    round_id = header.round
                    policy = self._policy()
                    rec = core.client_for(header.session)
                    sa, index = policy.begin_input(rec, header)  # length checked: bounded buffer
                    started = (policy, sa, index)
                    buf = bytearray(header.payload_bytes)
                elif kind == "data":
                    data = item if isinstance(item, memoryview) else memoryview(item.data)
                    end = received + len(data)
                    core.traffic.bytes_up += serde.data_chunk_wire_bytes(len(data))
                    if end > len(buf):
                        raise InvalidArgument(f"more payload than the {len(buf)} bytes the "
                                              f"header announced")
                    buf[received:end] = data
                    received = end
                else:
                    raise InvalidArgument("a masked input carries exactly one header chunk")
            if header is None:
                raise InvalidArgument("empty masked input: no header chunk")
            if received != len(buf):
                raise InvalidArgument(f"header announced {len(buf)} payload bytes, the stream "
                                      f"carried {received}")
            assert started is not None
            policy, sa, index = started
            identity = rec.public_key if core.config.security.require_identity else None
            taken, started = started, None  # from here the publisher's outcome ends it
            fut = core.publisher.submit(lambda: _check_and_fold(sa, header, buf, identity))
            fut.add_done_callback(lambda f: core.post(
                lambda: taken[0].end_input(taken[1], taken[2], f.exception() is None)))
            await wait_for_thread(fut)
        except ServiceError as exc:
            if started is not None:
                started[0].end_input(started[1], started[2], False)
            await self._abort(context, exc)
        return pb.SecAggAck(round=round_id)

    async def Poll(self, request: pb.SecAggPollRequest,
                   context: grpc.aio.ServicerContext) -> pb.SecAggState:
        try:
            self._parsed(request)
            check_number("wait_s", request.wait_s)
            policy = self._policy()
        except ServiceError as exc:
            await self._abort(context, exc)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(request.wait_s, 0.0), MAX_WAIT_S)
        seen: tuple[int, bool] | None = None
        view: ClientView | None = None
        while True:
            event = self._changed_event()
            # The answer a held poll waits for (its stage) moves only with the policy's
            # task_epoch, or when the session ends: other core changes (every push, join or
            # leave of the run) wake the poll without re-viewing the round, which costs a
            # neighbourhood's worth of work per waiting client.
            mark = (policy.task_epoch, request.session in self.core.sessions)
            if mark != seen or view is None:
                seen = mark
                try:
                    view = policy.view(self.core.client_for(request.session), request.round)
                except ServiceError as exc:
                    await self._abort(context, exc)
                if int(view.stage) != request.after:
                    return _state_to_proto(view)
            assert view is not None  # viewed above
            remaining = deadline - loop.time()
            if remaining <= 0:
                return _state_to_proto(view)
            try:
                await asyncio.wait_for(event.wait(),
                                       timeout=min(remaining, HELD_POLL_RECHECK_S))
            except asyncio.TimeoutError:
                seen = None  # the safety net: look again whatever the marks say


def _check_and_fold(sa: SecAggRound, header: object, payload: bytearray,
                    identity: bytes | None) -> None:
    """Publisher thread: the header's signature over the payload (model-sized hash), then the
    range check and the addition into the round's sum."""
    if identity is not None:
        message = signed_update_message(header, payload_digest(payload))  # type: ignore[arg-type]
        if not verify(identity, header.signature, message):  # type: ignore[attr-defined]
            raise Unauthenticated("the masked input is not signed by the session's key",
                                  reason="secagg input unsigned")
    sa.fold_input(payload)


def _state_to_proto(view: ClientView) -> pb.SecAggState:
    return pb.SecAggState(
        round=view.round_id, stage=cast("pb.SecAggState.Stage", int(view.stage)),
        index=view.index, threshold=view.threshold,
        n_max=view.n_max, reason=view.reason[:500], factor=view.factor,
        min_inputs=view.min_inputs,
        neighbours=[pb.SecAggPeer(index=p.index, client_id=p.client_id,
                                  mask_public_key=p.keys.mask_public_key,
                                  enc_public_key=p.keys.enc_public_key,
                                  self_commitment=p.keys.self_commitment,
                                  identity_key=p.keys.identity_key, signature=p.keys.signature)
                    for p in view.neighbours],
        ciphertexts=[pb.SecAggCiphertext(peer=j, ciphertext=ct) for j, ct in view.ciphertexts],
        included=list(view.included), dropped=list(view.dropped))


def add_secagg_servicer(servicer: SecureAggregationServicer, server: grpc.aio.Server) -> None:
    """Register the service; the masked input is framed by serde like Push's chunks."""
    def unary(fn: object, msg: type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=tolerant(msg.FromString, msg.__name__),  # type: ignore
            response_serializer=pb.SecAggAck.SerializeToString)

    handlers = {
        "AdvertiseKeys": unary(servicer.AdvertiseKeys, pb.SecAggKeys),
        "ShareKeys": unary(servicer.ShareKeys, pb.SecAggShares),
        "Unmask": unary(servicer.Unmask, pb.SecAggUnmask),
        "MaskedInput": grpc.stream_unary_rpc_method_handler(
            servicer.MaskedInput,
            request_deserializer=tolerant(serde.deserialize_update_item, "an UpdateChunk"),
            response_serializer=pb.SecAggAck.SerializeToString),
        "Poll": grpc.unary_unary_rpc_method_handler(
            servicer.Poll,
            request_deserializer=tolerant(pb.SecAggPollRequest.FromString, "SecAggPollRequest"),
            response_serializer=pb.SecAggState.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


__all__ = ["SERVICE", "SecureAggregationServicer", "add_secagg_servicer"]
