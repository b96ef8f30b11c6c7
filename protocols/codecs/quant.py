"""Stochastic block quantisation to int8 or int4 (QSGD-style), unbiased by construction.

Implementation based on QSGD, https://arxiv.org/abs/1610.02132, with one scale per block of
coordinates instead of one per vector: a single large coordinate then only coarsens its own block.

Each block of ``block`` values gets the scale ``s = max|x| / L`` (``L = 127`` for int8, ``7`` for
int4). A value ``x`` becomes ``y = x / s`` in ``[-L, L]`` and is rounded to ``floor(y)`` or
``floor(y) + 1`` with probabilities chosen so that ``E[q] = y``; the decoder returns ``q * s``.
The estimate is therefore unbiased (no error feedback needed) with per-coordinate variance at
most ``s**2 / 4``.

Wire layout after the 4-byte header: ``ceil(size / block)`` scales (float32 or float16,
little-endian), then the codes: int8 as one signed byte each; int4 as ``q + 8`` in a nibble, two
per byte, element ``2j`` in the low nibble. Codes ``-128`` (int8) and ``-8`` (int4) are never
produced and are refused, as is a non-zero padding nibble.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols.codecs._util import (
    F16_MAX,
    FLOAT_DTYPES,
    HEADER_BYTES,
    check_header,
    check_size,
    check_update,
    one_torch_thread,
    pack_header,
    parse_choice,
    read_floats,
)
from murmura.protocols.codecs.base import (
    Codec,
    CodecError,
    Encoder,
    FlatVector,
    check_payload_length,
    parse_int_option,
    register_codec,
    reject_leftover_options,
)

__all__ = ["Int4Codec", "Int8Codec"]

_F32_MAX = float(np.finfo(np.float32).max)


class _QuantCodec(Codec):
    """Shared machinery; subclasses fix the level count and the code packing."""

    levels: ClassVar[int]
    tag: ClassVar[int]

    def __init__(self, **options: str) -> None:
        opts = dict(options)
        self.block = parse_int_option(self.name, opts, "block", 256, low=1, high=1 << 24)
        self.scale_dtype = parse_choice(self.name, opts, "scale", "f32", FLOAT_DTYPES)
        reject_leftover_options(self.name, opts)
        self._flags = int(self.scale_dtype == np.float16)

    # -- layout ---------------------------------------------------------------------------------

    def _num_blocks(self, size: int) -> int:
        return -(-size // self.block)

    def _code_bytes(self, size: int) -> int:
        raise NotImplementedError

    def max_payload_bytes(self, size: int) -> int:
        check_size(self.name, size)
        return (HEADER_BYTES + self._num_blocks(size) * self.scale_dtype.itemsize
                + self._code_bytes(size))

    # -- codes ------------------------------------------------------------------------------------

    def _pack_codes(self, codes: npt.NDArray[np.int8]) -> bytes:
        raise NotImplementedError

    def _unpack_codes(self, payload: bytes | memoryview, offset: int,
                      size: int) -> npt.NDArray[np.int8]:
        raise NotImplementedError

    # -- scales -----------------------------------------------------------------------------------

    def _wire_scales(self, amax: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Per-block scales exactly as the decoder will read them, never below ``amax / L``.

        Rounding a scale down would push ``|x| / s`` past ``L`` and force clipping, which biases
        the estimate; so a float16 scale that rounded down is moved up by one ulp.
        """
        scale = (amax / np.float32(self.levels)).astype(np.float32)
        if self.scale_dtype == np.float32:
            return scale
        if scale.size and float(scale.max()) >= F16_MAX:
            raise CodecError(f"codec {self.name!r}: a block scale exceeds the float16 range; "
                             "use scale=f32")
        half = scale.astype(np.float16)
        too_small = half.astype(np.float32) * np.float32(self.levels) < amax
        half[too_small] = np.nextafter(half[too_small], np.float16(np.inf))
        return half.astype(np.float32)

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        check_size(self.name, size)
        return _QuantEncoder(self, size, seed)

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        return self.decode_into(payload, np.empty(size, dtype=np.float32))

    def decode_into(self, payload: bytes | memoryview, out: FlatVector, *,
                    reference: FlatVector | None = None) -> FlatVector:
        self._decode_codes(payload, out)
        return out

    def decode_bounded(self, payload: bytes | memoryview, size: int, *,
                       reference: FlatVector | None = None, out: FlatVector | None = None
                       ) -> tuple[FlatVector, float | None]:
        if out is None:
            out = np.empty(size, dtype=np.float32)
        elif out.size != size:
            raise CodecError(f"codec {self.name!r}: out has {out.size} values, expected {size}")
        codes, scales = self._decode_codes(payload, out)
        return out, _max_abs(codes, scales, self.block, self.levels)

    fusable = True

    def check(self, payload: bytes | memoryview, size: int) -> float:
        codes, scales = self._checked(payload, size)
        return _max_abs(codes, scales, self.block, self.levels)

    def fold_into(self, payload: bytes | memoryview, old: FlatVector, new: FlatVector,
                  alpha: float) -> bool:
        """``new = old + alpha * (code * scale)``, a few blocks at a time: the products go
        through a cache-sized buffer, not a model-sized one, and are the decoder's exact
        float32 values, added with torch's ``alpha`` as a dense fold adds them."""
        size = old.size
        codes, scales = self._checked(payload, size, validate=False)  # check() saw these bytes
        if not codes.flags.writeable:  # a bytes payload (tests): torch wants writable memory
            codes = codes.copy()
        if not scales.flags.writeable:
            scales = scales.copy()
        block = self.block
        rows = max(1, _FOLD_CHUNK // block)
        nfull = size // block
        with one_torch_thread():
            codes_t = torch.from_numpy(codes)
            scales_t = torch.from_numpy(scales)
            old_t, new_t = torch.from_numpy(old), torch.from_numpy(new)
            buf = torch.empty(min(rows, max(nfull, 1)) * block)
            for r0 in range(0, nfull, rows):
                r1 = min(r0 + rows, nfull)
                a, b = r0 * block, r1 * block
                tmp = buf[: b - a]
                tmp.copy_(codes_t[a:b])
                tmp.view(r1 - r0, block).mul_(scales_t[r0:r1, None])
                torch.add(old_t[a:b], tmp, alpha=alpha, out=new_t[a:b])
            full = nfull * block
            if full < size:
                tail = codes_t[full:].to(torch.float32).mul_(scales_t[-1])
                torch.add(old_t[full:], tail, alpha=alpha, out=new_t[full:])
        return False

    def _checked(self, payload: bytes | memoryview, size: int, *, validate: bool = True
                 ) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
        """The payload's codes and block scales, checked (every ``code * scale`` is then
        finite: scales are capped at float32 max / L). ``validate=False`` skips the pass over
        the codes, for bytes already checked."""
        check_size(self.name, size)
        check_header(self.name, payload, tag=self.tag, flags=self._flags)
        check_payload_length(self.name, payload, self.max_payload_bytes(size))
        nblocks = self._num_blocks(size)
        scales = read_floats(self.name, payload, HEADER_BYTES, nblocks, self.scale_dtype,
                             "block scale", nonnegative=True)
        if nblocks and float(scales.max()) > _F32_MAX / self.levels:
            bad = int(np.argmax(scales))
            raise CodecError(f"codec {self.name!r}: block scale {bad} is {scales[bad]}, which "
                             "overflows float32 when multiplied by a code")
        offset = HEADER_BYTES + nblocks * self.scale_dtype.itemsize
        codes = self._unpack_codes(payload, offset, size)
        limit = self.levels
        # Two reductions and no temporaries; the index of a bad code is found only when needed.
        if validate and size and (int(codes.min()) < -limit or int(codes.max()) > limit):
            bad = int(np.argmax((codes < -limit) | (codes > limit)))
            raise CodecError(f"codec {self.name!r}: code {int(codes[bad])} at index {bad} is "
                             f"outside [-{limit}, {limit}]")
        return codes, scales

    def _decode_codes(self, payload: bytes | memoryview, out: FlatVector
                      ) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
        """Check the payload, write ``code * scale`` into ``out``; the checked codes and
        scales."""
        size = out.size
        codes, scales = self._checked(payload, size)
        # code * scale in one pass, straight into out (int8 -> float32 is exact, so this is
        # bit-identical to converting first and scaling after)
        full = (size // self.block) * self.block
        nfull = size // self.block
        _scale_codes(codes[:full].reshape(nfull, self.block), scales[:nfull, None],
                     out[:full].reshape(nfull, self.block))
        if full < size:
            np.multiply(codes[full:], scales[-1], out=out[full:])
        return codes, scales


#: From this many codes the scaling runs in torch: a widening copy into ``out`` and an
#: in-place multiply took 4.3-5.9 ms for 10M codes on one core, NumPy's mixed-dtype multiply
#: 8.2-8.6 ms (it casts the int8 operand through small buffers). Below it NumPy's call is
#: cheaper. Both round once (int8 -> float32 is exact), so the results are bit-identical.
_TORCH_SCALE_FROM = 1 << 20


def _scale_codes(codes: npt.NDArray[np.int8], scales: npt.NDArray[np.float32],
                 out: npt.NDArray[np.float32]) -> None:
    """``out = codes * scales`` (scales broadcast along rows), on one torch thread.

    Read-only inputs (a payload in ``bytes``) take NumPy: torch would warn on them.
    """
    if (codes.size < _TORCH_SCALE_FROM or not codes.flags.writeable
            or not scales.flags.writeable):
        np.multiply(codes, scales, out=out)
        return
    with one_torch_thread():
        target = torch.from_numpy(out)
        target.copy_(torch.from_numpy(codes))
        target.mul_(torch.from_numpy(scales))


#: Values per step of :meth:`_QuantCodec.fold_into`: a 1 MB float32 buffer stays in L2.
_FOLD_CHUNK = 1 << 18

#: Rows whose largest code :func:`_max_abs` reads first (those with the largest scales).
_FIRST_ROWS = 16


def _max_abs(codes: npt.NDArray[np.int8], scales: npt.NDArray[np.float32], block: int,
             levels: int) -> float:
    """``max(abs(code * scale))`` over a decoded payload, exactly, reading few codes.

    ``|code * s|`` rounds as ``|code| * s`` does and rounding is monotone, so the largest
    magnitude is ``max_b float32(s_b * m_b)`` with ``m_b`` block ``b``'s largest ``|code|``; and
    a block whose ``float32(s_b * L)`` does not beat the best found so far cannot win. So the
    rows with the largest scales are read first, then only the rows that could still beat
    them: an honest encoder puts a code of +-L in every block, which leaves almost none (the
    whole vector is read only for a payload built to defeat this, at the cost of one pass).
    Codes must already be checked to lie in [-L, L].
    """
    size = codes.size
    if size == 0:
        return 0.0
    nfull = size // block
    full = nfull * block
    best = np.float32(0)
    if full < size:  # the short last block
        best = np.float32(scales[-1] * np.float32(np.max(np.abs(codes[full:]))))
    if nfull == 0:
        return float(best)
    rows = codes[:full].reshape(nfull, block)
    full_scales = scales[:nfull]
    bounds = full_scales * np.float32(levels)

    def exact(index: npt.NDArray[np.intp]) -> np.float32:
        largest = np.max(np.abs(rows[index]), axis=1).astype(np.float32)
        return np.float32(np.max(full_scales[index] * largest))

    first = (np.argpartition(bounds, nfull - _FIRST_ROWS)[nfull - _FIRST_ROWS:]
             if nfull > _FIRST_ROWS else np.arange(nfull))
    best = max(best, exact(first))
    rest = np.flatnonzero(bounds > best)
    if rest.size > nfull // 4:  # most rows could still win: one pass over all of them
        best = max(best, np.float32(np.max(
            full_scales * np.max(np.abs(rows), axis=1).astype(np.float32))))
    elif rest.size:
        best = max(best, exact(rest))
    return float(best)


class _QuantEncoder(Encoder):
    def __init__(self, codec: _QuantCodec, size: int, seed: int) -> None:
        self._codec, self._size = codec, size
        self._rng = np.random.default_rng(seed)

    def encode(self, update: FlatVector) -> bytes:
        codec = self._codec
        x = check_update(codec.name, update, self._size)
        block, levels = codec.block, np.float32(codec.levels)
        nblocks = codec._num_blocks(self._size)
        padded = np.zeros(nblocks * block, dtype=np.float32)
        padded[: self._size] = x
        rows = padded.reshape(nblocks, block)
        amax = np.abs(rows).max(axis=1) if nblocks else np.zeros(0, dtype=np.float32)
        scales = codec._wire_scales(amax)
        safe = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)
        y = np.clip(rows / safe[:, None], -levels, levels)
        low = np.floor(y)
        # Round up with probability frac = y - floor(y), so that E[code] = y exactly.
        up = self._rng.random(y.shape, dtype=np.float32) < (y - low)
        codes = (low + up).astype(np.int8).reshape(-1)[: self._size]
        return (pack_header(codec.tag, codec._flags)
                + scales.astype(codec.scale_dtype).tobytes()
                + codec._pack_codes(codes))


@register_codec
class Int8Codec(_QuantCodec):
    """int8 codes in [-127, 127] plus one scale per block: about 1 + 4/block bytes per value.

    Options: ``block`` (default 256), ``scale`` = ``f32`` (default) or ``f16``.
    """

    name = "int8"
    levels = 127
    tag = ord("8")

    def _code_bytes(self, size: int) -> int:
        return size

    def _pack_codes(self, codes: npt.NDArray[np.int8]) -> bytes:
        return codes.tobytes()

    def _unpack_codes(self, payload: bytes | memoryview, offset: int,
                      size: int) -> npt.NDArray[np.int8]:
        return np.frombuffer(payload, dtype=np.int8, count=size, offset=offset)


@register_codec
class Int4Codec(_QuantCodec):
    """int4 codes in [-7, 7], two per byte, plus one scale per block: about 0.5 + 4/block bytes.

    Options: ``block`` (default 256), ``scale`` = ``f32`` (default) or ``f16``.
    """

    name = "int4"
    levels = 7
    tag = ord("4")

    def _code_bytes(self, size: int) -> int:
        return (size + 1) // 2

    def _pack_codes(self, codes: npt.NDArray[np.int8]) -> bytes:
        nibbles = np.zeros(2 * self._code_bytes(codes.size), dtype=np.uint8)
        nibbles[: codes.size] = (codes + 8).astype(np.uint8)
        return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()

    def _unpack_codes(self, payload: bytes | memoryview, offset: int,
                      size: int) -> npt.NDArray[np.int8]:
        packed = np.frombuffer(payload, dtype=np.uint8, count=self._code_bytes(size),
                               offset=offset)
        nibbles = np.empty(2 * packed.size, dtype=np.uint8)
        nibbles[0::2] = packed & 0x0F
        nibbles[1::2] = packed >> 4
        if size % 2 and nibbles[-1] != 0:
            raise CodecError(f"codec {self.name!r}: the padding nibble after the last code is "
                             "not zero")
        return (nibbles[:size].astype(np.int8) - 8).astype(np.int8)
