"""Random-projection coding on seeded bases: K coefficients per block of B values.

Implementation based on the block-wise shared-randomness projection of Ferret (Shu et al.,
"Ferret: Federated Full-Parameter Tuning at Scale for Large Language Models",
https://arxiv.org/abs/2409.06277): client and server derive the same random bases from a seed,
so only the seed and the coordinates along those bases travel.

Our bases are K rows of a subsampled randomized Hadamard transform: for block ``b``,
``Z = S H D / sqrt(B)`` where ``D`` is a diagonal of Rademacher signs, ``H`` the Sylvester
Hadamard matrix of order ``B`` and ``S`` picks K distinct rows at random. Every row of ``Z`` is
a scaled Rademacher vector, like Ferret's bases, but the rows are exactly orthonormal, which buys
two things: the least-squares reconstruction ``Z^T (Z Z^T)^-1 c`` is just ``Z^T c`` (no Gram
matrix to invert, no ill-conditioning), and encoding and decoding cost ``O(B log B)`` per block
through two small dense Hadamard products instead of ``O(B K)`` random draws.

Signs and rows come from :mod:`murmura.protocols.prng`, so both peers build bit-identical bases
on any device. For an encode with payload seed ``s``, block ``b`` uses values
``b*B .. b*B+B-1`` of Rademacher stream ``s`` for ``D``, and picks the K rows ``r`` with the
smallest key ``word(derive_seed(s, 1), b*B + r) * 2**16 + r`` (keys are distinct, so the choice
does not depend on the selection algorithm), listed in increasing ``r``.

Modes:

* ``lsq`` (default): ``x_hat = Z^T Z x``, the orthogonal projection on the K directions. Biased
  (``E[x_hat] = (K/B) x``) but a contraction, ``E|x - x_hat|^2 = (1 - K/B) |x|^2``, which is
  exactly what error feedback needs; feedback is on by default.
* ``unbiased``: ``x_hat = (B/K) Z^T Z x``, unbiased over the random rows, with variance
  ``(B/K - 1) |x|^2``. Error feedback would amplify that variance, so it is refused in this mode.

Wire layout after the 4-byte header: the 64-bit payload seed, then ``ceil(size/B) * K``
coefficients (float32 or float16), block-major.
"""

from __future__ import annotations

import struct
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from murmura.protocols import prng
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

__all__ = ["ProjCodec", "hadamard"]

_TAG = ord("p")
_SEED = struct.Struct("<Q")
_MAX_BLOCK = 1 << 16
#: Blocks are processed in groups of about this many values to bound the temporaries.
_CHUNK_VALUES = 1 << 20


@lru_cache(maxsize=16)
def hadamard(order: int) -> npt.NDArray[np.float32]:
    """Sylvester Hadamard matrix of a power-of-two order: ``H_2n = [[H, H], [H, -H]]``."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {order}")
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < order:
        h = np.block([[h, h], [h, -h]])
    h.setflags(write=False)
    return h


def _transform(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Multiply every row (length ``B``) by ``H_B``, using ``H_B = H_a kron H_b`` with a*b = B."""
    count, order = rows.shape
    bits = order.bit_length() - 1
    a, b = 1 << ((bits + 1) // 2), 1 << (bits // 2)
    grid = rows.reshape(count, a, b)
    mixed: npt.NDArray[np.float32] = np.matmul(np.matmul(hadamard(a), grid), hadamard(b))
    return mixed.reshape(count, order)


@register_codec
class ProjCodec(Codec):
    """K seeded orthonormal Rademacher-Hadamard coefficients per block of B values.

    Options: ``block`` (B, a power of two, default 4096), ``k`` (default 64), ``values`` =
    ``f32`` (default) or ``f16``, ``mode`` = ``lsq`` (default) or ``unbiased``, ``feedback``
    (default 1 for ``lsq``; must be 0 for ``unbiased``). About ``K * value bytes / B`` bytes per
    value plus 12 bytes.
    """

    name = "proj"

    def __init__(self, **options: str) -> None:
        opts = dict(options)
        self.block = parse_int_option(self.name, opts, "block", 4096, low=2, high=_MAX_BLOCK)
        if self.block & (self.block - 1):
            raise CodecError(f"codec {self.name!r}: option block={self.block} must be a power "
                             "of two")
        self.k = parse_int_option(self.name, opts, "k", min(64, self.block), low=1,
                                  high=self.block)
        self.value_dtype = parse_choice(self.name, opts, "values", "f32", FLOAT_DTYPES)
        self.unbiased = parse_choice(self.name, opts, "mode", "lsq",
                                     {"lsq": False, "unbiased": True})
        self.feedback = parse_flag(self.name, opts, "feedback", not self.unbiased)
        if self.feedback and self.unbiased:
            raise CodecError(f"codec {self.name!r}: feedback=1 needs mode=lsq; the unbiased "
                             "estimate is not a contraction and error feedback would amplify it")
        reject_leftover_options(self.name, opts)
        self._flags = int(self.value_dtype == np.float16) | (int(self.unbiased) << 1)

    def layout(self, size: int) -> tuple[int, int, int]:
        """``(B, K, number of blocks)`` for a vector of ``size`` values.

        A vector shorter than ``block`` uses the smallest power of two that holds it (and at most
        that many coefficients), so a small tensor is not projected from a mostly-empty block.
        """
        check_size(self.name, size)
        block = min(self.block, max(2, 1 << (size - 1).bit_length())) if size else self.block
        return block, min(self.k, block), -(-size // block)

    def max_payload_bytes(self, size: int) -> int:
        _, k, nblocks = self.layout(size)
        return HEADER_BYTES + _SEED.size + nblocks * k * self.value_dtype.itemsize

    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        check_size(self.name, size)
        return _ProjEncoder(self, size, seed)

    # -- the shared bases -----------------------------------------------------------------------

    @staticmethod
    def _bases(seed: int, block: int, k: int, first: int, count: int
               ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Signs ``(count, B)`` and selected rows ``(count, K)`` of blocks ``first..``."""
        signs = prng.rademacher_reference(seed, count * block, offset=first * block)
        if k == block:
            rows = np.broadcast_to(np.arange(block, dtype=np.int64), (count, block))
            return signs.reshape(count, block), rows
        words = prng.hash_words_reference(prng.derive_seed(seed, 1), count * block,
                                          offset=first * block)
        keys = (words.astype(np.int64) << 16).reshape(count, block) | np.arange(block)
        rows = np.sort(np.argpartition(keys, k - 1, axis=1)[:, :k], axis=1)
        return signs.reshape(count, block), rows

    def _project(self, x: FlatVector, seed: int) -> npt.NDArray[np.float32]:
        """Coefficients ``Z x`` of every block, shape ``(num_blocks, K)``."""
        block, k, nblocks = self.layout(x.size)
        coeffs = np.empty((nblocks, k), dtype=np.float32)
        norm = np.float32(1 / np.sqrt(block))
        group = max(1, _CHUNK_VALUES // block)
        for first in range(0, nblocks, group):
            count = min(group, nblocks - first)
            signs, rows = self._bases(seed, block, k, first, count)
            part = np.zeros(count * block, dtype=np.float32)
            chunk = x[first * block : (first + count) * block]
            part[: chunk.size] = chunk
            mixed = _transform(part.reshape(count, block) * signs)
            coeffs[first : first + count] = np.take_along_axis(mixed, rows, axis=1) * norm
        return coeffs

    def _reconstruct(self, coeffs: npt.NDArray[np.float32], seed: int, size: int) -> FlatVector:
        """``Z^T c`` per block (times ``B/K`` in unbiased mode), truncated to ``size``."""
        block, k, nblocks = self.layout(size)
        out = np.empty(nblocks * block, dtype=np.float32)
        gain = np.float32((block / k if self.unbiased else 1.0) / np.sqrt(block))
        group = max(1, _CHUNK_VALUES // block)
        for first in range(0, nblocks, group):
            count = min(group, nblocks - first)
            signs, rows = self._bases(seed, block, k, first, count)
            spread = np.zeros((count, block), dtype=np.float32)
            np.put_along_axis(spread, rows, coeffs[first : first + count], axis=1)
            part = _transform(spread) * signs
            part *= gain
            out[first * block : (first + count) * block] = part.reshape(-1)
        return out[:size]

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        check_size(self.name, size)
        check_header(self.name, payload, tag=_TAG, flags=self._flags)
        check_payload_length(self.name, payload, self.max_payload_bytes(size))
        (seed,) = _SEED.unpack_from(payload, HEADER_BYTES)
        _, k, nblocks = self.layout(size)
        coeffs = read_floats(self.name, payload, HEADER_BYTES + _SEED.size, nblocks * k,
                             self.value_dtype, "coefficient")
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, precisely
            out = self._reconstruct(coeffs.reshape(nblocks, k), seed, size)
        if not np.isfinite(out).all():
            raise CodecError(f"codec {self.name!r}: the coefficients overflow float32 when "
                             "rebuilt")
        return out


class _ProjEncoder(Encoder):
    def __init__(self, codec: ProjCodec, size: int, seed: int) -> None:
        self._codec, self._size, self._seed, self._count = codec, size, seed, 0
        self.residual = np.zeros(size if codec.feedback else 0, dtype=np.float32)

    def encode(self, update: FlatVector) -> bytes:
        codec = self._codec
        x = check_update(codec.name, update, self._size)
        corrected = x + self.residual if codec.feedback else x
        # A fresh basis every round: a fixed one would never reach the orthogonal complement.
        seed = prng.derive_seed(self._seed, self._count)
        self._count += 1
        coeffs = to_wire_floats(codec.name, codec._project(corrected, seed), codec.value_dtype,
                                "coefficient")
        if codec.feedback:
            sent = codec._reconstruct(coeffs.astype(np.float32), seed, self._size)
            self.residual = corrected - sent
        return pack_header(_TAG, codec._flags) + _SEED.pack(seed) + coeffs.tobytes()
