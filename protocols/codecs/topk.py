"""Top-k sparsification with client-side error feedback and Elias-Fano coded indices.

Error feedback follows Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory",
https://arxiv.org/abs/1809.07599: what a round does not send stays in a residual that is added to
the next update, so every coordinate is eventually delivered and the running sum of decoded
updates tracks the running sum of true updates to within one residual.

Indices are sorted and coded with Elias-Fano (Elias 1974, Fano 1971): each index is split into
``l = floor(log2(size / k))`` low bits, stored verbatim, and a high part whose successive
differences (the delta code) are written in unary. That costs at most ``l + 2`` bits per index
whatever the distribution of the indices, against about 8.6 bits for LEB128 varints of the gaps
at ``ratio=0.01`` (and up to 32 bits for a clustered update), so the payload size is a fixed
function of ``size`` and ``k``: exact ``max_payload_bytes``, no data-dependent length to trust.

Wire layout after the 4-byte header: ``k`` values (float32 or float16, in index order), then the
``k * l`` low bits, then the ``k + ((size - 1) >> l)`` high bits, each bit string padded with
zero bits to a whole byte, little-endian bit order.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import numpy.typing as npt

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
    CodecError,
    Encoder,
    FlatVector,
    check_payload_length,
    parse_float_option,
    register_codec,
    reject_leftover_options,
)

__all__ = ["TopKCodec", "elias_fano_decode", "elias_fano_encode", "elias_fano_layout"]

_TAG = ord("k")


def elias_fano_layout(size: int, k: int) -> tuple[int, int, int]:
    """``(l, low_bits, high_bits)`` for ``k`` distinct indices in ``[0, size)``."""
    if k == 0:
        return 0, 0, 0
    low = (size // k).bit_length() - 1
    return low, k * low, k + ((size - 1) >> low)


def elias_fano_encode(indices: npt.NDArray[np.int64], size: int) -> bytes:
    """Code strictly increasing ``indices`` in ``[0, size)``: low bits, then high bits."""
    k = indices.size
    low, low_bits, high_bits = elias_fano_layout(size, k)
    if k == 0:
        return b""
    shifts = np.arange(low, dtype=np.int64)
    lows = ((indices[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)
    highs = np.zeros(high_bits, dtype=np.uint8)
    highs[(indices >> low) + np.arange(k, dtype=np.int64)] = 1
    return (np.packbits(lows, bitorder="little").tobytes()
            + np.packbits(highs, bitorder="little").tobytes())


def elias_fano_decode(codec: str, payload: bytes | memoryview, offset: int, size: int,
                      k: int) -> npt.NDArray[np.int64]:
    """Inverse of :func:`elias_fano_encode`; refuses anything but k sorted, distinct, in-range."""
    low, low_bits, high_bits = elias_fano_layout(size, k)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    lows = unpack_bits(codec, payload, offset, low_bits, "index low bits")
    highs = unpack_bits(codec, payload, offset + (low_bits + 7) // 8, high_bits,
                        "index high bits")
    ones = np.flatnonzero(highs)
    if ones.size != k:
        raise CodecError(f"codec {codec!r}: the index high bits hold {ones.size} entries, "
                         f"expected {k}")
    indices = (ones - np.arange(k, dtype=np.int64)) << low
    if low:
        weights = np.left_shift(np.int64(1), np.arange(low, dtype=np.int64))
        indices |= lows.reshape(k, low).astype(np.int64) @ weights
    if int(indices[-1]) >= size:
        raise CodecError(f"codec {codec!r}: index {int(indices[-1])} at position {k - 1} is out "
                         f"of range [0, {size})")
    steps = np.diff(indices)
    if steps.size and int(steps.min()) <= 0:
        bad = int(np.argmin(steps)) + 1
        raise CodecError(f"codec {codec!r}: index {int(indices[bad])} at position {bad} does not "
                         f"exceed the previous index {int(indices[bad - 1])} (unsorted or "
                         "duplicate)")
    return indices


@register_codec
class TopKCodec(Codec):
    """The ``k = ceil(ratio * size)`` largest-magnitude values, with error feedback.

    Options: ``ratio`` (default 0.01), ``values`` = ``f32`` (default) or ``f16``, ``feedback``
    = 1 (default) or 0. Costs ``k * (value bytes + (l + 2) / 8)`` bytes plus a 4-byte header.
    """

    name = "topk"

    def __init__(self, **options: str) -> None:
        opts = dict(options)
        self.ratio = parse_float_option(self.name, opts, "ratio", 0.01, low=1e-9, high=1.0)
        # k from the shortest decimal of the ratio, not its binary double: ceil(0.07 * 100) is 7.
        self._ratio_exact = Fraction(repr(self.ratio))
        self.value_dtype = parse_choice(self.name, opts, "values", "f32", FLOAT_DTYPES)
        self.feedback = parse_flag(self.name, opts, "feedback", True)
        reject_leftover_options(self.name, opts)
        self._flags = int(self.value_dtype == np.float16)

    def k(self, size: int) -> int:
        """Number of values sent for a vector of ``size``: at least 1 unless size is 0."""
        check_size(self.name, size)
        return min(size, max(1 if size else 0, math.ceil(self._ratio_exact * size)))

    def max_payload_bytes(self, size: int) -> int:
        k = self.k(size)
        _, low_bits, high_bits = elias_fano_layout(size, k)
        return (HEADER_BYTES + k * self.value_dtype.itemsize + (low_bits + 7) // 8
                + (high_bits + 7) // 8)

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        check_size(self.name, size)
        return _TopKEncoder(self, size)

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        return self.decode_into(payload, np.empty(size, dtype=np.float32))

    def decode_into(self, payload: bytes | memoryview, out: FlatVector, *,
                    reference: FlatVector | None = None) -> FlatVector:
        indices, values = self._parse(payload, out.size)
        out.fill(0.0)
        out[indices] = values
        return out

    def _parse(self, payload: bytes | memoryview, size: int
               ) -> tuple[npt.NDArray[np.int64], FlatVector]:
        """The payload's strictly increasing indices and their values, checked."""
        check_size(self.name, size)
        check_header(self.name, payload, tag=_TAG, flags=self._flags)
        check_payload_length(self.name, payload, self.max_payload_bytes(size))
        k = self.k(size)
        values = read_floats(self.name, payload, HEADER_BYTES, k, self.value_dtype, "value")
        indices = elias_fano_decode(self.name, payload,
                                    HEADER_BYTES + k * self.value_dtype.itemsize, size, k)
        return indices, values

    fusable = True

    def check(self, payload: bytes | memoryview, size: int) -> float:
        _, values = self._parse(payload, size)  # read_floats refuses NaN and Inf
        return float(np.max(np.abs(values))) if values.size else 0.0

    def sparse(self, payload: bytes | memoryview, size: int
               ) -> tuple[npt.NDArray[np.int64], FlatVector]:
        indices, values = self._parse(payload, size)
        return indices, values.astype(np.float32, copy=False)

    def fold_into(self, payload: bytes | memoryview, old: FlatVector, new: FlatVector,
                  alpha: float) -> bool:
        """``old[i] += alpha * value_i`` at the k indices, in place (returns True)."""
        indices, values = self.sparse(payload, old.size)
        old[indices] += np.float32(alpha) * values
        return True


class _TopKEncoder(Encoder):
    def __init__(self, codec: TopKCodec, size: int) -> None:
        self._codec, self._size, self._k = codec, size, codec.k(size)
        self.residual = np.zeros(size if codec.feedback else 0, dtype=np.float32)

    def encode(self, update: FlatVector) -> bytes:
        codec = self._codec
        x = check_update(codec.name, update, self._size)
        corrected = x + self.residual if codec.feedback else x
        k = self._k
        if k == self._size:
            indices = np.arange(k, dtype=np.int64)
        else:
            indices = np.sort(np.argpartition(np.abs(corrected), self._size - k)[self._size - k:])
            indices = indices.astype(np.int64)
        values = to_wire_floats(codec.name, corrected[indices], codec.value_dtype, "value")
        if codec.feedback:
            # The residual is what the server will not see, float16 rounding included.
            corrected[indices] -= values.astype(np.float32)
            self.residual = corrected
        return (pack_header(_TAG, codec._flags) + values.tobytes()
                + elias_fano_encode(indices, self._size))
