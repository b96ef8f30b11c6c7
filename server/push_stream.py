"""Reading one Push stream into the buffer its payload lands in.

The gateway's servicer and a receiver process (server/receivers.py) take pushes the same way:
the header chunk first, checked before any payload byte is accepted, then the payload chunks
copied straight into their place in a lease (a receive buffer, a shared-memory slab, or a
receiver's view of one). Only where the lease comes from differs, so that is a callback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from murmura.protocols import UpdateHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.serde import Malformed
from murmura.server.errors import InvalidArgument

__all__ = ["Lease", "PushStream"]


class Lease(Protocol):
    """Where a payload lands: ``write(offset, data)`` copies a chunk into its place."""

    def write(self, offset: int, data: memoryview) -> None: ...


class PushStream:
    """One push being received. After :meth:`read`, ``header``, ``lease`` (the caller
    discards it if the push fails before it is handed on), ``received`` payload bytes and
    ``wire`` bytes (the chunk messages' serialized size)."""

    __slots__ = ("expected", "header", "lease", "received", "wire")

    def __init__(self) -> None:
        self.header: UpdateHeader | None = None
        self.lease: Any = None
        self.received = self.wire = self.expected = 0

    async def read(self, items: AsyncIterator[pb.UpdateChunk | memoryview | Malformed],
                   open_lease: Callable[[UpdateHeader], Awaitable[Lease]]) -> UpdateHeader:
        """Receive the whole stream; ``open_lease(header)`` checks the header and returns
        the lease (or raises the refusal) before any payload chunk is taken. Raises
        :class:`InvalidArgument` for a stream that is not one header and its payload."""
        async for item in items:
            # Payload chunks arrive as zero-copy views of gRPC's message bytes
            # (serde.deserialize_update_item) and are copied once, straight into their place
            # in the buffer or slab that the decode, the spool and the fold read.
            if type(item) is memoryview:
                if self.lease is None:
                    raise InvalidArgument("the first chunk of a push must be its header")
                self._write(item)
                continue
            if isinstance(item, Malformed):
                raise InvalidArgument(f"{item.what} does not parse")
            kind = item.WhichOneof("kind")
            if self.header is None:
                if kind != "header":
                    raise InvalidArgument("the first chunk of a push must be its header")
                self.wire += item.ByteSize()
                header = serde.update_header_from_proto(item.header)
                # Checked and given a place before any payload is received; each chunk is then
                # copied in as it arrives, overlapping the transfer.
                self.lease = await open_lease(header)
                self.header, self.expected = header, header.payload_bytes
            elif kind == "data":  # a data chunk a peer framed with another field set
                self._write(memoryview(item.data))
            else:
                raise InvalidArgument("a push carries exactly one header chunk")
        if self.header is None:
            raise InvalidArgument("empty push: no header chunk")
        if self.received != self.header.payload_bytes:
            raise InvalidArgument(f"header announced {self.header.payload_bytes} payload bytes, "
                                  f"the stream carried {self.received}")
        return self.header

    def _write(self, data: memoryview) -> None:
        end = self.received + len(data)
        if end > self.expected:
            raise InvalidArgument(f"more payload than the {self.expected} bytes the header "
                                  f"announced")
        self.lease.write(self.received, data)
        self.wire += serde.data_chunk_wire_bytes(len(data))
        self.received = end
