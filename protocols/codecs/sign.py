"""Scaled sign compression (1 bit per value) with error feedback.

Implementation based on EF-signSGD, Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", https://arxiv.org/abs/1901.09847: the client adds its residual to
the update, sends ``scale * sign`` per block, and keeps what that missed. The scale of a block is
its mean absolute value, which minimises the block's squared error among all ``s * sign(x)``.
Plain signSGD is biased and can diverge; with the residual the running sum of decoded updates
stays within one residual of the running sum of true updates.

Wire layout after the 4-byte header: ``ceil(size / block)`` scales (float32 or float16), then
``size`` bits, little-endian bit order, 0 for ``+scale`` and 1 for ``-scale``, padded with zero
bits to a whole byte.
"""

from __future__ import annotations

import numpy as np

from murmura.protocols.codecs._util import (
    FLOAT_DTYPES,
    HEADER_BYTES,
    check_header,
    check_size,
    check_update,
    pack_header,
    parse_choice,
    parse_flag,
    read_floats,
    to_wire_floats,
    unpack_bits,
)
from murmura.protocols.codecs.base import (
    Codec,
    Encoder,
    FlatVector,
    check_payload_length,
    parse_int_option,
    register_codec,
    reject_leftover_options,
)

__all__ = ["SignCodec"]

_TAG = ord("s")


@register_codec
class SignCodec(Codec):
    """One sign bit per value plus one scale per block: about 1/8 + 4/block bytes per value.

    Options: ``block`` (default 1024: the scales then cost 3 % on top of the bits, 31x fewer
    bytes than float32, where 256 costs 12.5 % and caps the ratio at 28x), ``scale`` = ``f32``
    (default) or ``f16``, ``feedback`` = 1 (default) or 0.
    """

    name = "sign"

    def __init__(self, **options: str) -> None:
        opts = dict(options)
        self.block = parse_int_option(self.name, opts, "block", 1024, low=1, high=1 << 24)
        self.scale_dtype = parse_choice(self.name, opts, "scale", "f32", FLOAT_DTYPES)
        self.feedback = parse_flag(self.name, opts, "feedback", True)
        reject_leftover_options(self.name, opts)
        self._flags = int(self.scale_dtype == np.float16)

    def _num_blocks(self, size: int) -> int:
        return -(-size // self.block)

    def max_payload_bytes(self, size: int) -> int:
        check_size(self.name, size)
        return HEADER_BYTES + self._num_blocks(size) * self.scale_dtype.itemsize + (size + 7) // 8

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        check_size(self.name, size)
        return _SignEncoder(self, size)

    def _expand(self, scales: np.ndarray, negative: np.ndarray, size: int) -> FlatVector:
        """The decoded vector ``+-scale`` per value (shared by the decoder and the residual)."""
        per_value = np.repeat(scales, self.block)[:size]
        return np.where(negative, -per_value, per_value).astype(np.float32)

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        check_size(self.name, size)
        check_header(self.name, payload, tag=_TAG, flags=self._flags)
        check_payload_length(self.name, payload, self.max_payload_bytes(size))
        nblocks = self._num_blocks(size)
        scales = read_floats(self.name, payload, HEADER_BYTES, nblocks, self.scale_dtype,
                             "block scale", nonnegative=True)
        bits = unpack_bits(self.name, payload, HEADER_BYTES + nblocks * self.scale_dtype.itemsize,
                           size, "sign bits")
        return self._expand(scales, bits.astype(bool), size)


class _SignEncoder(Encoder):
    def __init__(self, codec: SignCodec, size: int) -> None:
        self._codec, self._size = codec, size
        self.residual = np.zeros(size if codec.feedback else 0, dtype=np.float32)

    def encode(self, update: FlatVector) -> bytes:
        codec = self._codec
        x = check_update(codec.name, update, self._size)
        corrected = x + self.residual if codec.feedback else x
        nblocks, block = codec._num_blocks(self._size), codec.block
        padded = np.zeros(nblocks * block, dtype=np.float32)
        padded[: self._size] = np.abs(corrected)
        counts = np.full(nblocks, block, dtype=np.float32)
        if nblocks:
            counts[-1] = self._size - (nblocks - 1) * block
        means = (padded.reshape(nblocks, block).sum(axis=1, dtype=np.float64) / counts)
        wire = to_wire_floats(codec.name, means.astype(np.float32), codec.scale_dtype,
                              "block scale")
        negative = corrected < 0
        if codec.feedback:
            self.residual = corrected - codec._expand(wire.astype(np.float32), negative,
                                                      self._size)
        return (pack_header(_TAG, codec._flags) + wire.tobytes()
                + np.packbits(negative, bitorder="little").tobytes())
