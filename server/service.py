"""The gRPC face of the aggregator: decode the request, call the core, encode the answer.

Domain errors become gRPC statuses here and nowhere else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from murmura.protocols import UpdateHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.protocols.pool import POOL_SCALARS_CODEC
from murmura.protocols.serde import Malformed, tolerant
from murmura.server.buffers import ReceiveBuffer
from murmura.server.core import AggregatorCore
from murmura.server.errors import InvalidArgument, ServiceError, Unavailable
from murmura.server.futures import wait_for_thread
from murmura.server.limits import MAX_TEXT, check_number, check_text
from murmura.server.pipeline import PushPipeline
from murmura.server.push_stream import PushStream
from murmura.server.slabs import Slab
from murmura.server.telemetry import timed_handlers
from murmura.server.tier import Tier

log = logging.getLogger(__name__)

#: gRPC message limit: one chunk plus headroom; anything larger is refused by gRPC itself.
MAX_MESSAGE_BYTES = 4 * serde.CHUNK_BYTES
MAX_WAIT_S = 30.0
#: A held GetTask poll asks the core again when the task signature moves (``_notify``) and,
#: as a safety net, at most this many seconds after it last asked. Every answer a waiting
#: client can get is gated by a signature field (rounds, versions, publishing, sessions while
#: no round is open, secure aggregation's stages), and deadlines move it through ``tick``;
#: at 0.5 s the net alone cost 2 task calls per waiting client per second on the event loop
#: (20,000 a second with 10,000 clients waiting between rounds).
HELD_POLL_RECHECK_S = 5.0
#: Trailing metadata of a back-pressure refusal: milliseconds to wait before retrying (the
#: client's GrpcTransport reads the same key).
RETRY_AFTER_KEY = "murmura-retry-after-ms"


class LogLimiter:
    """At most ``per_minute`` log lines per kind of refusal, then one line saying how many were
    left out: a flood of bad requests cannot flood the log."""

    def __init__(self, per_minute: int = 20, *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._window: dict[str, tuple[float, int, int]] = {}  # kind -> (start, logged, dropped)

    def log(self, kind: str, msg: str, *args: object) -> None:
        now = self.clock()
        start, logged, dropped = self._window.get(kind, (now, 0, 0))
        if now - start >= 60.0:
            if dropped:
                log.info("%d more %s refusals in the last minute were not logged", dropped, kind)
            start, logged, dropped = now, 0, 0
        if logged < self.per_minute:
            log.info(msg, *args)
            logged += 1
        else:
            dropped += 1
        self._window[kind] = (start, logged, dropped)


#: The points where a handler waits and its client may cancel it: every one is safe (the test
#: suite cancels a call at each through :attr:`AggregatorServicer.await_hook`).
AWAIT_POINTS = ("join.durable", "push.receive", "push.duplicate", "push.decode", "push.spool",
                "push.durable", "push.publish", "push.install")


class AggregatorServicer(pb_grpc.AggregatorServicer):
    def __init__(self, core: AggregatorCore, *, tier: Tier | None = None,
                 chunk_bytes: int = serde.CHUNK_BYTES) -> None:
        self.core = core
        self.chunk_bytes = chunk_bytes
        #: Where payloads land and who decodes them (in-process unless a tier is given).
        self.tier = tier or Tier(dataclasses.replace(core.config.tier, workers=0), core.decoder)
        #: The steps every push takes (server/pipeline.py); this servicer lands the stream.
        self.pipeline = PushPipeline(core, self.tier)
        self._event: asyncio.Event | None = None
        self._signature: tuple[Any, ...] = ()  # the core's task signature at the last wake
        self.log_limit = LogLimiter()
        #: Non-zero while receiver processes take pushes on this port (server/receivers.py):
        #: Join tells clients.
        self.push_port = 0
        #: Tests: called with the name of each await point (AWAIT_POINTS) just before the
        #: handler waits there, e.g. to cancel the handler's task at that point.
        self.await_hook: Callable[[str], None] | None = None
        core.add_listener(self._notify)

    def _at(self, point: str) -> None:
        if self.await_hook is not None:
            self.await_hook(point)

    @property
    def buffers(self):  # noqa: ANN201 - the in-process receive buffers (tests inspect them)
        return self.tier.buffers

    def _notify(self) -> None:
        """Wake the held GetTask polls, but only when their answer may have changed (the
        core's task signature moved): waking every poll at every accepted update made a sync
        round of n clients cost O(n^2) task calls on the event loop."""
        if self._event is None:
            return
        signature = self.core.task_signature()
        if signature == self._signature:
            return
        self._signature = signature
        self._event.set()
        self._event = asyncio.Event()

    def _changed_event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
            self._signature = self.core.task_signature()
        return self._event

    async def _refuse_malformed(self, context: grpc.aio.ServicerContext, bad: Malformed) -> None:
        self.core.count_refusal("INVALID_ARGUMENT", "malformed request")
        self.log_limit.log("malformed", "malformed request refused: %s", bad.what)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{bad.what} does not parse")

    async def _checked(self, context: grpc.aio.ServicerContext, check: Callable[[], Any]) -> None:
        """Run a field check; refuse if it fails."""
        try:
            check()
        except ServiceError as exc:
            await self._abort(context, exc)

    async def _abort(self, context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
        """Answer a refusal (counted here unless the core counted it)."""
        self.core.count_refusal(exc)
        await abort_with(context, exc)

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
                   ) -> pb.JoinReply:
        if isinstance(request, Malformed):
            await self._refuse_malformed(context, request)
        try:
            result = self.core.join(request.client_id, serde.profile_from_proto(request.profile),
                                    token=request.token,
                                    protocol_version=request.protocol_version,
                                    proof=serde.join_proof_from_proto(request))
            self._at("join.durable")
            await _durable(self.core.last_durable, "the session")
        except ServiceError as exc:
            self.log_limit.log(exc.status, "join refused: %s %s", exc.status, exc.message)
            await self._abort(context, exc)
        if self.push_port:
            result = dataclasses.replace(result, push_port=self.push_port)
        return serde.join_result_to_proto(result, self.core.spec)

    async def Challenge(self, request: pb.ChallengeRequest, context: grpc.aio.ServicerContext
                        ) -> pb.ChallengeReply:
        if isinstance(request, Malformed):
            await self._refuse_malformed(context, request)
        nonce, ttl = self.core.challenge()
        return pb.ChallengeReply(nonce=nonce, expires_in_s=ttl)

    async def GetTask(self, request: pb.TaskRequest, context: grpc.aio.ServicerContext
                      ) -> pb.TaskReply:
        if isinstance(request, Malformed):
            await self._refuse_malformed(context, request)
        await self._checked(context, lambda: check_number("wait_s", request.wait_s))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(request.wait_s, 0.0), MAX_WAIT_S)
        while True:
            event = self._changed_event()
            try:
                task = self.core.task(request.session)
            except ServiceError as exc:
                await self._abort(context, exc)
            remaining = deadline - loop.time()
            if task.action != task.action.WAIT or remaining <= 0:
                return serde.task_to_proto(task)
            try:  # wake when the signature moves; the recheck is only a safety net
                await asyncio.wait_for(event.wait(),
                                       timeout=min(remaining, HELD_POLL_RECHECK_S))
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                # The client went away mid-wait (process exited, connection broke): unless it
                # calls again soon, its session ends and no round waits for it.
                self.core.lost_contact(request.session)
                raise

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[pb.ModelChunk | memoryview]:
        if isinstance(request, Malformed):
            await self._refuse_malformed(context, request)
        kind = request.kind
        try:
            if kind == pb.PullRequest.MODEL:
                version, params = self.core.model(request.session)
                spec, codec, base_version = self.core.spec, "dense-f32", 0
            elif kind == pb.PullRequest.POOL_BASE:
                base_version, params = self.core.pool_base(request.session)
                version, spec, codec = base_version, self.core.spec, "dense-f32"
            elif kind == pb.PullRequest.POOL_SCALARS:
                version, base_version, params = self.core.pool_scalars(request.session)
                spec, codec = None, POOL_SCALARS_CODEC
            else:
                raise InvalidArgument(f"unknown pull kind {kind}")
        except ServiceError as exc:
            await self._abort(context, exc)
        payload = params.data.cast("B")  # published vectors are never modified
        for item in serde.iter_model_items(version, spec, codec, payload, self.chunk_bytes,
                                           base_version=base_version):
            self.core.add_download(serde.data_chunk_wire_bytes(len(item))
                                   if isinstance(item, memoryview) else item.ByteSize())
            yield item

    async def Push(self, request_iterator: AsyncIterator[pb.UpdateChunk | memoryview],
                   context: grpc.aio.ServicerContext) -> pb.PushReply:
        """Header checks, the payload straight into its buffer, decoding by an aggregation
        function (a worker process unless ``workers = 0``), then the policy; the event loop
        itself only moves bytes."""
        stream = PushStream()
        try:
            self._at("push.receive")
            header = await stream.read(request_iterator, self._open)  # type: ignore[arg-type]
            taken, stream.lease = stream.lease, None  # the pipeline owns it now
            result = await self.pipeline.complete(header, taken, stream.received, stream.wire,
                                                  cancelled=context.cancelled, at=self._at)
        except ServiceError as exc:
            self.log_limit.log(exc.status, "push refused: %s %s", exc.status, exc.message)
            await self._abort(context, exc)
        finally:
            if stream.lease is not None:
                self.tier.discard(stream.lease)
        return serde.push_result_to_proto(result)

    async def _open(self, header: UpdateHeader) -> ReceiveBuffer | Slab:
        """The checks a header allows, then the buffer its payload lands in."""
        self.pipeline.precheck(header)  # refuse before receiving a payload
        return self.pipeline.receive(header.payload_bytes)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        if isinstance(request, Malformed):
            await self._refuse_malformed(context, request)
        await self._checked(context, lambda: check_text("reason", request.reason, MAX_TEXT,
                                                        allow_empty=True))
        try:
            self.core.leave(request.session)
        except ServiceError as exc:
            await self._abort(context, exc)
        return pb.LeaveReply()


async def _durable(fut: object, what: str) -> None:
    """Wait (off the loop) until a durable operation is on disk; UNAVAILABLE if it failed.
    A cancelled wait leaves the operation to finish (see server/futures.py)."""
    if fut is None:
        return
    try:
        await wait_for_thread(fut)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the store logged it
        raise Unavailable(f"{what} could not be made durable; retry later") from exc


SERVICE = "murmura.v1.Aggregator"


async def abort_with(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    """End the call with the refusal's status, and its retry hint in the trailing metadata
    (the gateway's servicer and the receivers answer refusals alike)."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(1000 * exc.retry_after_s))),))
    await context.abort(grpc.StatusCode[exc.status], exc.message)


def push_handler(push: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """Push's method handler: payload chunks read as zero-copy views (serde.frame_data)."""
    return grpc.stream_unary_rpc_method_handler(
        push, request_deserializer=tolerant(serde.deserialize_update_item, "an UpdateChunk"),
        response_serializer=pb.PushReply.SerializeToString)


def add_servicer(servicer: AggregatorServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated ``add_AggregatorServicer_to_server``, except
    that Push and Pull frame payload chunks themselves (see ``serde.frame_data``)."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join, request_deserializer=tolerant(pb.JoinRequest.FromString, "JoinRequest"),
            response_serializer=pb.JoinReply.SerializeToString),
        "GetTask": grpc.unary_unary_rpc_method_handler(
            servicer.GetTask,
            request_deserializer=tolerant(pb.TaskRequest.FromString, "TaskRequest"),
            response_serializer=pb.TaskReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=tolerant(pb.PullRequest.FromString, "PullRequest"),
            response_serializer=serde.serialize_model_item),
        "Push": push_handler(servicer.Push),
        "Leave": grpc.unary_unary_rpc_method_handler(
            servicer.Leave,
            request_deserializer=tolerant(pb.LeaveRequest.FromString, "LeaveRequest"),
            response_serializer=pb.LeaveReply.SerializeToString),
        "Challenge": grpc.unary_unary_rpc_method_handler(
            servicer.Challenge,
            request_deserializer=tolerant(pb.ChallengeRequest.FromString, "ChallengeRequest"),
            response_serializer=pb.ChallengeReply.SerializeToString),
    }
    handlers = timed_handlers(handlers, servicer.core.telemetry.observe_rpc)  # RPC latency
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
