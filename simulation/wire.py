"""Bytes on the wire, computed without building protobuf messages.

The gRPC transport counts ``sum(chunk.ByteSize())`` over the chunk stream of each push and
pull (:func:`murmura.protocols.serde.iter_update_chunks` / ``iter_model_chunks``). Building a
message per simulated update would cost more than the rest of the update's bookkeeping, so
these functions apply the protobuf encoding rules to the same fields instead. A test checks
them against ``ByteSize()`` on random headers and payload sizes, chunk boundaries included.
"""

from __future__ import annotations

from typing import Any

from murmura.protocols import ModelSpec, UpdateHeader, serde


def varint_size(value: int) -> int:
    """Bytes of a protobuf varint; negative int64 values always take ten."""
    if value < 0:
        return 10
    return (value.bit_length() + 6) // 7 or 1


def _len_delimited(n: int) -> int:
    """A length-delimited field (string, bytes, message) of ``n`` bytes with a 1-byte tag."""
    return 1 + varint_size(n) + n


def _string(text: str) -> int:
    n = len(text.encode()) if not text.isascii() else len(text)
    return _len_delimited(n) if n else 0


def _int(value: int) -> int:
    return 1 + varint_size(value) if value else 0


def _text_key(text: str) -> int | str:
    """What a string's encoded size depends on: its length if ASCII, else the text."""
    return len(text) if text.isascii() else text


_HEADERS: dict[tuple[Any, ...], int] = {}


def update_header_bytes(h: UpdateHeader) -> int:
    """``serde.update_header_to_proto(h).ByteSize()``.

    Cached by everything the size depends on (string lengths, integers, metric names; not
    metric values, which are fixed-width doubles): a round's updates share a few keys.
    """
    key = (_text_key(h.session), _text_key(h.update_id), h.codec, h.spec_fingerprint,
           tuple(h.metrics), h.base_version, h.round, h.num_examples, h.payload_bytes)
    size = _HEADERS.get(key)
    if size is None:
        size = (_string(h.session) + _string(h.update_id) + _string(h.codec)
                + _string(h.spec_fingerprint) + _int(h.base_version) + _int(h.round)
                + _int(h.num_examples) + _int(h.payload_bytes))
        for name in h.metrics:  # map entries carry key and value even if default
            k = len(name.encode())
            size += _len_delimited(1 + varint_size(k) + k + 9)
        if len(_HEADERS) > 100_000:
            _HEADERS.clear()
        _HEADERS[key] = size
    return size


def _data_chunks(payload_bytes: int, chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    full, rest = divmod(payload_bytes, chunk_bytes)
    return full * _len_delimited(chunk_bytes) + (_len_delimited(rest) if rest else 0)


_DATA: dict[tuple[int, int], int] = {}


def update_wire_bytes(h: UpdateHeader, chunk_bytes: int = serde.CHUNK_BYTES) -> int:
    """Bytes of one push's chunk stream: what the aggregator adds to ``bytes_up``."""
    key = (h.payload_bytes, chunk_bytes)
    data = _DATA.get(key)
    if data is None:
        if len(_DATA) > 10_000:
            _DATA.clear()
        data = _DATA[key] = _data_chunks(h.payload_bytes, chunk_bytes)
    return _len_delimited(update_header_bytes(h)) + data


class ModelWire:
    """Bytes of one pull's chunk stream (what the aggregator adds to ``bytes_down``)."""

    def __init__(self, spec: ModelSpec, codec: str = "dense-f32",
                 chunk_bytes: int = serde.CHUNK_BYTES) -> None:
        self.spec_bytes = serde.spec_to_proto(spec).ByteSize()
        self.codec = codec
        self.payload_bytes = spec.nbytes
        self.chunk_bytes = chunk_bytes
        self._data = _data_chunks(self.payload_bytes, chunk_bytes)
        self._version, self._size = -1, 0

    def __call__(self, version: int) -> int:
        if version != self._version:  # every pull of one version has the same size
            header = (_int(version) + _len_delimited(self.spec_bytes) + _string(self.codec)
                      + _int(self.payload_bytes))
            self._size = _len_delimited(header) + self._data
            self._version = version
        return self._size


__all__ = ["ModelWire", "update_header_bytes", "update_wire_bytes", "varint_size"]
