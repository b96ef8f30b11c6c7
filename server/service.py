"""The gRPC face of the aggregator: decode the request, call the core, encode the answer.

Domain errors become gRPC statuses here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.protocols import serde
from murmura.server.core import AggregatorCore
from murmura.server.errors import InvalidArgument, ServiceError

log = logging.getLogger(__name__)

#: gRPC message limit: one chunk plus headroom; anything larger is refused by gRPC itself.
MAX_MESSAGE_BYTES = 4 * serde.CHUNK_BYTES
MAX_WAIT_S = 30.0


class AggregatorServicer(pb_grpc.AggregatorServicer):
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

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
        await context.abort(grpc.StatusCode[exc.status], exc.message)

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
                   ) -> pb.JoinReply:
        try:
            result = self.core.join(request.client_id, serde.profile_from_proto(request.profile),
                                    token=request.token,
                                    protocol_version=request.protocol_version)
        except ServiceError as exc:
            await self._abort(context, exc)
        return serde.join_result_to_proto(result, self.core.spec)

    async def GetTask(self, request: pb.TaskRequest, context: grpc.aio.ServicerContext
                      ) -> pb.TaskReply:
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
            try:  # wake on any state change, and at least twice a second for deadlines
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[pb.ModelChunk]:
        try:
            version, params = self.core.model(request.session)
        except ServiceError as exc:
            await self._abort(context, exc)
        payload = memoryview(params).cast("B")  # published vectors are never modified
        for chunk in serde.iter_model_chunks(version, self.core.spec, "dense-f32", payload,
                                             self.chunk_bytes):
            self.core.add_download(chunk.ByteSize())
            yield chunk

    async def Push(self, request_iterator: AsyncIterator[pb.UpdateChunk],
                   context: grpc.aio.ServicerContext) -> pb.PushReply:
        header = None
        buf = bytearray()
        received = wire = 0
        try:
            async for chunk in request_iterator:
                wire += chunk.ByteSize()
                kind = chunk.WhichOneof("kind")
                if header is None:
                    if kind != "header":
                        raise InvalidArgument("the first chunk of a push must be its header")
                    header = serde.update_header_from_proto(chunk.header)
                    self.core.precheck(header)  # refuse before receiving a payload
                    buf = bytearray(header.payload_bytes)
                elif kind == "data":
                    end = received + len(chunk.data)
                    if end > header.payload_bytes:
                        raise InvalidArgument(f"more payload than the {header.payload_bytes} "
                                              f"bytes the header announced")
                    buf[received:end] = chunk.data
                    received = end
                else:
                    raise InvalidArgument("a push carries exactly one header chunk")
            if header is None:
                raise InvalidArgument("empty push: no header chunk")
            if received != header.payload_bytes:
                raise InvalidArgument(f"header announced {header.payload_bytes} payload bytes, "
                                      f"the stream carried {received}")
            result = self.core.push(header, memoryview(buf), wire_bytes=wire)
        except ServiceError as exc:
            log.info("push refused: %s %s", exc.status, exc.message)
            await self._abort(context, exc)
        return serde.push_result_to_proto(result)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        try:
            self.core.leave(request.session)
        except ServiceError as exc:
            await self._abort(context, exc)
        return pb.LeaveReply()
