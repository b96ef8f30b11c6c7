"""Dense codecs: the whole vector in float32 or float16, little-endian."""

from __future__ import annotations

import numpy as np

from murmura.protocols.codecs.base import (
    Codec,
    CodecError,
    Encoder,
    FlatVector,
    check_payload_length,
    register_codec,
)

_F16_MAX = float(np.finfo(np.float16).max)
#: Little-endian float32, the dense-f32 wire format (equal to native float32 on most hosts).
_WIRE_F32 = np.dtype("<f4")


class _DenseEncoder(Encoder):
    def __init__(self, codec: str, dtype: str, size: int) -> None:
        self._codec, self._dtype, self._size = codec, np.dtype(dtype), size

    def encode(self, update: FlatVector) -> bytes:
        if update.shape != (self._size,):
            raise CodecError(f"codec {self._codec!r}: update has shape {update.shape}, "
                             f"expected ({self._size},)")
        if self._dtype == np.float16 and update.size and float(np.abs(update).max()) > _F16_MAX:
            raise CodecError(f"codec {self._codec!r}: update exceeds the float16 range "
                             f"(|x| > {_F16_MAX}); use dense-f32")
        return np.ascontiguousarray(update, dtype=self._dtype).tobytes()

    def encode_view(self, update: FlatVector) -> memoryview | None:
        # float32 already in wire order: the payload is the update's own bytes (no float16
        # range to check). A copy is made only where the update is not contiguous.
        if self._dtype != _WIRE_F32 or update.dtype != _WIRE_F32:
            return None
        if update.shape != (self._size,):
            raise CodecError(f"codec {self._codec!r}: update has shape {update.shape}, "
                             f"expected ({self._size},)")
        return np.ascontiguousarray(update).data.cast("B")


@register_codec
class DenseF32(Codec):
    """Every value as float32: 4 bytes per parameter, lossless."""

    name = "dense-f32"

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        return _DenseEncoder(self.name, "<f4", size)

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        check_payload_length(self.name, payload, 4 * size)
        return np.frombuffer(payload, dtype="<f4").astype(np.float32, copy=False)

    def max_payload_bytes(self, size: int) -> int:
        return 4 * size


@register_codec
class DenseF16(Codec):
    """Every value as IEEE float16: 2 bytes per parameter, about 3 significant digits."""

    name = "dense-f16"

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        return _DenseEncoder(self.name, "<f2", size)

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        check_payload_length(self.name, payload, 2 * size)
        return np.frombuffer(payload, dtype="<f2").astype(np.float32)

    def max_payload_bytes(self, size: int) -> int:
        return 2 * size
