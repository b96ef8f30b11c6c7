"""Wire format of a partial aggregate that a leaf aggregator pushes to its parent.

A leaf folds its clients' updates into a weighted sum, their total weight and their number,
and sends that state up like a heavy client. The sum is either float32 (kind 0) or the exact
fixed-point accumulator's two int64 limbs per value (kind 1: ``N = hi * 2**60 + lo``, the value
``N * 2**-80``, ``0 <= lo < 2**60``, ``|hi| < 2**62``; see ``murmura.aggregation.ExactSum``).
``protocols/`` may not import ``aggregation/``, so this module works on plain arrays.

Layout, little-endian, 24-byte header then the data::

    magic u8 (0xB5) | tag u8 ('P') | version u8 (1) | kind u8 | size u32
    weight f64 (> 0, finite) | count u64 (>= 1)
    kind 0: size x f32 sum              kind 1: size x i64 hi, then size x i64 lo

The header keeps the data 8-byte aligned, so the decoded arrays are zero-copy views.

Partials do not travel through the update codec registry: the ``partial`` codec registered
here only refuses, with a message saying where such a payload belongs, so that a client which
names it on the ordinary update path gets a clear error rather than garbage.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from murmura.protocols.codecs._util import MAGIC
from murmura.protocols.codecs.base import Codec, CodecError, Encoder, FlatVector, register_codec

__all__ = [
    "KIND_EXACT",
    "KIND_F32",
    "PARTIAL_CODEC",
    "PartialCodec",
    "PartialPayload",
    "decode_partial",
    "encode_partial",
    "partial_payload_bytes",
]

PARTIAL_CODEC = "partial"
TAG = ord("P")
VERSION = 1
KIND_F32, KIND_EXACT = 0, 1
HEADER = struct.Struct("<BBBBIdQ")
HEADER_BYTES = HEADER.size  # 24
#: The exact accumulator's limb layout (murmura.aggregation.partial; a test keeps them equal).
LIMB_BITS = 60
HI_LIMIT = 1 << 62
_BYTES_PER_VALUE = {KIND_F32: 4, KIND_EXACT: 16}
_KIND_NAMES = {KIND_F32: "float32", KIND_EXACT: "exact"}

Limbs = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PartialPayload:
    """A decoded partial aggregate: plain arrays, validated.

    ``sum_f32`` (kind float32) or ``limbs`` = ``(hi, lo)`` (kind exact) is set, the other is
    None. The arrays are read-only views of the payload when it is ``bytes`` (no copy); over a
    writable buffer they alias it, so copy them before the buffer is reused.
    """

    weight: float
    count: int
    exact: bool
    sum_f32: FlatVector | None = None
    limbs: tuple[Limbs, Limbs] | None = None

    @property
    def size(self) -> int:
        if self.sum_f32 is not None:
            return int(self.sum_f32.size)
        assert self.limbs is not None
        return int(self.limbs[0].size)


def partial_payload_bytes(size: int, *, exact: bool) -> int:
    """The exact payload length for ``size`` values."""
    return HEADER_BYTES + _BYTES_PER_VALUE[KIND_EXACT if exact else KIND_F32] * size


def _check_scalars(weight: float, count: int) -> None:
    if not (isinstance(weight, float | int | np.floating | np.integer)
            and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0):
        raise CodecError(f"partial: weight must be a finite number > 0, got {weight!r}")
    if isinstance(count, bool) or not isinstance(count, int | np.integer) \
            or not 1 <= count < 1 << 64:
        raise CodecError(f"partial: count must be an integer in [1, 2**64), got {count!r}")


def _check_limbs(hi: npt.NDArray[np.int64], lo: npt.NDArray[np.int64]) -> None:
    bad_lo = (lo < 0) | (lo >= 1 << LIMB_BITS)
    if bad_lo.any():
        i = int(np.argmax(bad_lo))
        raise CodecError(f"partial: lo limb {i} is {int(lo[i])}, outside [0, 2**{LIMB_BITS})")
    bad_hi = (hi <= -HI_LIMIT) | (hi >= HI_LIMIT)
    if bad_hi.any():
        i = int(np.argmax(bad_hi))
        raise CodecError(f"partial: hi limb {i} is {int(hi[i])}, beyond the exact "
                         f"accumulator's range (|hi| < 2**62)")


def encode_partial(*, weight: float, count: int, sum_f32: npt.NDArray[np.float32] | None = None,
                   limbs: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None,
                   ) -> bytes:
    """Encode a partial aggregate; exactly one of ``sum_f32`` and ``limbs`` is given.

    Refuses (CodecError) whatever :func:`decode_partial` would refuse, so a leaf learns about a
    bad partial before it sends it.
    """
    _check_scalars(weight, count)
    if (sum_f32 is None) == (limbs is None):
        raise CodecError("partial: give exactly one of sum_f32 (float32) and limbs (exact)")
    if sum_f32 is not None:
        vector = np.asarray(sum_f32)
        if vector.dtype != np.float32 or vector.ndim != 1 or vector.size == 0:
            raise CodecError(f"partial: sum_f32 must be a non-empty 1-d float32 array, got "
                             f"{vector.dtype} of shape {vector.shape}")
        finite = np.isfinite(vector)
        if not finite.all():
            i = int(np.argmin(finite))
            raise CodecError(f"partial: sum value {i} is {vector[i]} (must be finite)")
        kind, size, data = KIND_F32, vector.size, [vector.astype("<f4", copy=False)]
    else:
        assert limbs is not None
        if len(limbs) != 2:
            raise CodecError(f"partial: limbs must be a pair (hi, lo), got {len(limbs)} arrays")
        hi, lo = np.asarray(limbs[0]), np.asarray(limbs[1])
        if hi.dtype != np.int64 or lo.dtype != np.int64 or hi.ndim != 1 \
                or hi.shape != lo.shape or hi.size == 0:
            raise CodecError(f"partial: limbs must be two non-empty 1-d int64 arrays of one "
                             f"length, got {hi.dtype}{hi.shape} and {lo.dtype}{lo.shape}")
        _check_limbs(hi, lo)
        kind, size = KIND_EXACT, hi.size
        data = [hi.astype("<i8", copy=False), lo.astype("<i8", copy=False)]
    if size >= 1 << 32:
        raise CodecError(f"partial: {size} values do not fit the format's u32 size field")
    header = HEADER.pack(MAGIC, TAG, VERSION, kind, size, float(weight), int(count))
    return b"".join([header, *(np.ascontiguousarray(d).tobytes() for d in data)])


def decode_partial(payload: bytes | bytearray | memoryview, size: int) -> PartialPayload:
    """Parse and validate a partial aggregate of ``size`` values (from an untrusted leaf)."""
    if size <= 0:
        raise CodecError(f"partial: size must be positive, got {size}")
    view = memoryview(payload).cast("B")
    if len(view) < HEADER_BYTES:
        raise CodecError(f"partial: payload is {len(view)} bytes, shorter than the "
                         f"{HEADER_BYTES}-byte header")
    magic, tag, version, kind, got_size, weight, count = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"partial: bad header magic 0x{magic:02x} (expected 0x{MAGIC:02x})")
    if tag != TAG:
        raise CodecError(f"partial: payload is not a partial aggregate (tag {chr(tag)!r}, "
                         f"expected {chr(TAG)!r}); was it encoded by an update codec?")
    if version != VERSION:
        raise CodecError(f"partial: unsupported format version {version} (this build reads "
                         f"{VERSION})")
    if kind not in _BYTES_PER_VALUE:
        raise CodecError(f"partial: unknown kind {kind} (0 = float32, 1 = exact limbs)")
    if got_size != size:
        raise CodecError(f"partial: payload holds {got_size} values, the model has {size}")
    expected = partial_payload_bytes(size, exact=kind == KIND_EXACT)
    if len(view) != expected:
        raise CodecError(f"partial: payload is {len(view)} bytes, expected {expected} for "
                         f"{size} {_KIND_NAMES[kind]} values")
    if not (math.isfinite(weight) and weight > 0):
        raise CodecError(f"partial: weight must be finite and > 0, got {weight}")
    if count < 1:
        raise CodecError(f"partial: count must be >= 1, got {count}")
    if kind == KIND_F32:
        vector = np.frombuffer(view, dtype="<f4", count=size, offset=HEADER_BYTES)
        # NaN and Inf propagate through a sum: one reduction clears the common case.
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.add.reduce(vector, dtype=np.float32)
        if not np.isfinite(total):
            finite = np.isfinite(vector)
            if not finite.all():
                i = int(np.argmin(finite))
                raise CodecError(f"partial: sum value {i} is {vector[i]} (must be finite)")
        return PartialPayload(weight=weight, count=count, exact=False,
                              sum_f32=vector.astype(np.float32, copy=False))
    hi = np.frombuffer(view, dtype="<i8", count=size, offset=HEADER_BYTES)
    lo = np.frombuffer(view, dtype="<i8", count=size, offset=HEADER_BYTES + 8 * size)
    _check_limbs(hi, lo)
    return PartialPayload(weight=weight, count=count, exact=True,
                          limbs=(hi.astype(np.int64, copy=False), lo.astype(np.int64, copy=False)))


@register_codec
class PartialCodec(Codec):
    """Placeholder so the name ``partial`` is taken and refused on the update path.

    A partial aggregate is not an update: its parent decodes it with :func:`decode_partial`
    and merges it with its weight and count, which an update codec cannot carry.
    """

    name = PARTIAL_CODEC

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        raise CodecError("codec 'partial' does not encode client updates: a leaf aggregator "
                         "builds its payload with encode_partial(weight=, count=, sum_f32= or "
                         "limbs=)")

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        raise CodecError("codec 'partial' carries a leaf's partial aggregate, not a client "
                         "update: partial payloads are decoded with decode_partial() by an "
                         "aggregator that accepts partials, not on this update path")
