"""A receiver process (``--receivers``): Push streams into slabs the gateway lends.

Started by :class:`~murmura.server.receivers.ReceiverHub` as ``python -m
murmura.server.receiver_process`` with its settings on stdin; server/receivers.py explains the
design. This module also holds the hub link's framing, which both sides use: a 4-byte length,
then a pickled tuple (both ends are this server's own processes, and the hub admits only one
that knows its token).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import pickle
import signal
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from murmura.protocols import UpdateHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.server.errors import ServiceError, Unavailable
from murmura.server.push_stream import PushStream
from murmura.server.slabs import SlabRef, attach, detach_all
from murmura.server.tier import DecodedMeta, check_payload_job

if TYPE_CHECKING:
    from murmura.server.decoding import Decoder

__all__ = ["Frames", "TlsFiles", "receiver_main", "send_message"]

#: The most bytes one hub message may have (a header, a result, a refusal: all far smaller).
MAX_FRAME = 1 << 20
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class TlsFiles:
    """The server's TLS files, read again by each receiver."""

    cert: str
    key: str
    client_ca: str = ""


# -- framing -------------------------------------------------------------------------------


def send_message(writer: asyncio.StreamWriter | asyncio.WriteTransport,
                 message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LEN.pack(len(data)) + data)


class Frames:
    """A link's reader: bytes in as they arrive, whole messages out (no coroutine per
    message: the gateway handles two of them per push)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[Any, ...]]:
        """Every message ``data`` completes; ``ConnectionError`` for a malformed stream."""
        buf = self._buf
        buf += data
        out = []
        while len(buf) >= _LEN.size:
            size = _LEN.unpack_from(buf)[0]
            if size > MAX_FRAME:
                raise ConnectionError(f"a hub message of {size} bytes (at most {MAX_FRAME})")
            end = _LEN.size + size
            if len(buf) < end:
                break
            message = pickle.loads(bytes(buf[_LEN.size:end]))
            del buf[:end]
            if not isinstance(message, tuple) or not message:
                raise ConnectionError("a hub message that is not a tuple")
            out.append(message)
        return out


# -- the receiver process ------------------------------------------------------------------


class _RemoteLease:
    """A slab lent by the gateway, as a receiver maps it."""

    __slots__ = ("buf", "lease_id")

    def __init__(self, lease_id: int, name: str, size: int) -> None:
        self.lease_id = lease_id
        self.buf = attach(SlabRef(name, 0, size))

    def write(self, offset: int, data: memoryview) -> None:
        self.buf[offset:offset + len(data)] = data


class _HubClient:
    """A receiver's link to the hub: requests with ids, answers matched to them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self.closed = False

    def send(self, *message: Any) -> None:
        if not self.closed:
            send_message(self.writer, message)

    async def call(self, kind: str, *args: Any) -> Any:
        if self.closed:
            raise Unavailable("the aggregator is restarting its receivers; retry the push")
        rid = next(self._ids)
        future = self._pending[rid] = asyncio.get_running_loop().create_future()
        send_message(self.writer, (kind, rid, *args))
        try:
            return await future
        except asyncio.CancelledError:
            self.send("cancel", rid)
            raise
        finally:
            self._pending.pop(rid, None)

    async def run(self) -> None:
        """Match answers to calls until the hub closes the link (or breaks the framing)."""
        frames = Frames()
        try:
            while data := await self.reader.read(1 << 16):
                for status, rid, value in frames.feed(data):
                    future = self._pending.get(rid)
                    if future is None or future.done():
                        continue
                    if status == "ok":
                        future.set_result(value)
                    else:  # a refusal the gateway counted already
                        value.counted = True
                        future.set_exception(value)
        except ConnectionError:
            pass
        self.closed = True
        for future in self._pending.values():
            if not future.done():
                gone = Unavailable("the aggregator's gateway went away; retry the push")
                gone.counted = True  # nobody is left to count it
                future.set_exception(gone)


class _ReceiverServicer:
    """Push only: the stream into a lent slab, the rest by the gateway."""

    def __init__(self, hub: _HubClient, decoder: Decoder | None) -> None:
        self.hub = hub
        #: Set when the gateway wants payloads of fusable codecs checked here.
        self.decoder = decoder

    async def _check(self, header: UpdateHeader, payload: memoryview
                     ) -> DecodedMeta | ServiceError | None:
        """A worker's payload check, run here (off this loop): its meta, or its refusal."""
        if self.decoder is None or not self.decoder.fusable(header.codec):
            return None
        try:
            return await asyncio.to_thread(check_payload_job, self.decoder, header.codec,
                                           payload)
        except ServiceError as exc:
            return exc  # refused by the gateway, at the step where a worker's check is

    async def _open(self, header: UpdateHeader) -> _RemoteLease:
        lease_id, name, size = await self.hub.call("open", header)
        try:
            return _RemoteLease(lease_id, name, size)
        except Exception:
            self.hub.send("discard", lease_id)
            raise

    async def Push(self, request_iterator: AsyncIterator[pb.UpdateChunk | memoryview],
                   context: grpc.aio.ServicerContext) -> pb.PushReply:
        from murmura.server.service import abort_with

        stream = PushStream()
        try:
            header = await stream.read(request_iterator, self._open)  # type: ignore[arg-type]
            checked = await self._check(header, stream.lease.buf[:stream.received])
            lease, stream.lease = stream.lease, None
            result = await self.hub.call("complete", lease.lease_id, stream.received,
                                         stream.wire, checked)
        except ServiceError as exc:
            if not exc.counted:  # refused here (the stream itself): the gateway counts it
                self.hub.send("refused", exc)
            await abort_with(context, exc)
        finally:
            if stream.lease is not None:
                self.hub.send("discard", stream.lease.lease_id)
        return serde.push_result_to_proto(result)


def receiver_main(index: int, hub_path: str, token: str, host: str, port: int,
                  tls: TlsFiles | None, max_message_bytes: int) -> None:
    """A receiver process: serve Push on ``host:port`` until the hub's link closes."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s receiver-{index} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops its receivers itself
    try:
        asyncio.run(_receive(index, hub_path, token, host, port, tls, max_message_bytes))
    except (OSError, RuntimeError) as exc:  # cannot bind, or the TLS files: one line, exit 1
        logging.getLogger(__name__).error("receiver %d stopped: %s", index, exc)
        sys.exit(1)
    finally:
        detach_all()


async def _receive(index: int, hub_path: str, token: str, host: str, port: int,
                   tls: TlsFiles | None, max_message_bytes: int) -> None:
    from murmura.protocols.tls import server_credentials
    from murmura.server.service import SERVICE, push_handler

    reader, writer = await asyncio.open_unix_connection(hub_path)
    hub = _HubClient(reader, writer)
    answers = asyncio.create_task(hub.run())
    decoder = await hub.call("hello", token, index)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1),  # the receivers share one port
    ])
    servicer = _ReceiverServicer(hub, decoder)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Push": push_handler(servicer.Push)}),))
    address = f"{host}:{port}"
    if tls is not None:
        bound = server.add_secure_port(address, server_credentials(
            tls.cert, tls.key, tls.client_ca or None))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"receiver {index} could not bind {address}")
    await server.start()
    hub.send("ready", bound)
    try:
        await answers
    finally:
        await server.stop(1.0)


if __name__ == "__main__":  # started by ReceiverHub with its settings on stdin
    _given = json.loads(sys.stdin.readline())
    receiver_main(_given["index"], _given["hub"], _given["token"], _given["host"],
                  _given["port"], TlsFiles(**_given["tls"]) if _given["tls"] else None,
                  _given["max_message_bytes"])
