"""Weighted updates in the ring: how FedAvg's weighted mean survives masking.

FedAvg needs ``sum_i w_i u_i / sum_i w_i``. Under secure aggregation the server may only learn
sums, so each client puts both numerator terms into one ring vector: its weighted update
``omega_i * u_i`` (each value clipped to ``[-clip, clip]``) followed by one more element,
``omega_i * clip``. The unmasked sum then holds the weighted sum and, in its last element, the
total weight: the server learns the cohort's total weight, never one client's. The weight is
``omega_i = min(examples_i, max_weight) / max_weight`` in ``(0, 1]``, so ``|omega_i u_i|`` and
``omega_i clip`` both lie within ``clip`` and :class:`~murmura.protocols.secagg.ring.FieldSpec`'s
range inequality makes overflow of the sum impossible. Clients with more than ``max_weight``
examples count as ``max_weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from murmura.protocols.secagg.ring import FieldSpec, RingVector, dequantise, quantise

#: Codec names of a masked input on the wire: little-endian 4-byte words for rings of up to 32
#: bits (the same bytes per value as dense float32), 8-byte words above.
RING_CODECS = {32: "secagg-ring32", 64: "secagg-ring64"}


@dataclass(frozen=True)
class SecAggParams:
    """The run's secure-aggregation encoding, sent to clients when they join."""

    bits: int = 32
    clip: float = 1.0
    max_weight: float = 1000.0
    #: Distributed DP (0: off): each client clips its update to this L2 norm, weighs 1, and
    #: adds its share of Gaussian noise before masking (:func:`encode_weighted`).
    dp_clip: float = 0.0
    #: z: the noise on the sum of at least ``min_inputs`` clients has std ``z * dp_clip``.
    dp_noise_multiplier: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.dp_clip) and self.dp_clip >= 0
                and math.isfinite(self.dp_noise_multiplier) and self.dp_noise_multiplier >= 0):
            raise ValueError("secagg dp_clip and dp_noise_multiplier must be finite and >= 0")
        if self.dp_noise_multiplier and not self.dp_clip:
            raise ValueError("distributed DP noise needs a clip (dp_clip > 0)")
        if not 8 <= self.bits <= 64:
            raise ValueError(f"secagg bits must be in [8, 64], got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"secagg clip must be finite and positive, got {self.clip}")
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise ValueError(f"secagg max_weight must be positive, got {self.max_weight}")

    @property
    def word_bytes(self) -> int:
        """Bytes per ring element on the wire."""
        return 4 if self.bits <= 32 else 8

    @property
    def codec(self) -> str:
        return RING_CODECS[8 * self.word_bytes]

    def vector_length(self, update_size: int) -> int:
        """Ring elements of one masked input: the update, then the weight."""
        return update_size + 1

    @property
    def distributed_dp(self) -> bool:
        return self.dp_clip > 0

    def omega(self, examples: float) -> float:
        """A client's weight in ``(0, 1]``: zero examples is refused, more than
        ``max_weight`` examples count as ``max_weight``. With distributed DP every client
        weighs 1: a reported example count is unbounded and would void the sensitivity."""
        if not (math.isfinite(examples) and examples > 0):
            raise ValueError(f"a client's example count must be positive, got {examples}")
        if self.distributed_dp:
            return 1.0
        return min(float(examples), self.max_weight) / self.max_weight

    def noise_std(self, min_inputs: int) -> float:
        """One client's share of the noise: the sum of ``min_inputs`` such shares (the fewest
        inputs a round is unmasked with) has std ``z * dp_clip``; more inputs only add noise."""
        if min_inputs < 1:
            raise ValueError(f"min_inputs must be >= 1, got {min_inputs}")
        return self.dp_noise_multiplier * self.dp_clip / math.sqrt(min_inputs)


def encode_weighted(update: npt.ArrayLike, examples: float, params: SecAggParams, *,
                    n_max: int, rng: np.random.Generator | None = None,
                    factor: float = 1.0, min_inputs: int = 0,
                    noise_rng: np.random.Generator | None = None) -> RingVector:
    """``[factor * omega * clip(u), omega * clip]`` quantised into ``Z_{2**bits}`` for
    ``n_max`` clients.

    Values are clipped to ``[-clip, clip]`` *before* weighting, on the client, which is what
    bounds every ring element and so makes the sum's range provable. ``factor`` in ``[0, 1]``
    scales the update but not its weight: FedBuff's staleness discount, which shrinks a stale
    update's step instead of renormalising it away.

    Distributed DP (``params.dp_clip > 0``): the update is scaled to L2 norm at most
    ``dp_clip`` (then by ``factor``), weighs 1, and gets ``N(0, noise_std(min_inputs)^2)`` on
    every value from ``noise_rng`` before the values are cut to ``[-clip, clip]`` and
    quantised; the server never sees an un-noised sum.
    """
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"the update's factor must lie in [0, 1], got {factor}")
    omega = params.omega(examples)
    values = np.asarray(update, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"update must be a flat vector, got shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("update holds NaN or infinite values")
    full = np.empty(values.shape[0] + 1, dtype=np.float64)
    if params.distributed_dp:  # clip to the L2 norm, scale, add this client's noise share
        norm = float(np.sqrt(np.dot(values, values)))
        scale = factor * min(1.0, params.dp_clip / norm) if norm > 0 else factor
        noised = values * scale
        std = params.noise_std(min_inputs)
        if std > 0:
            if noise_rng is None:
                raise ValueError("distributed DP needs a noise generator")
            noised += noise_rng.standard_normal(values.shape[0]) * std
        np.clip(noised, -params.clip, params.clip, out=full[:-1])
    else:
        np.multiply(np.clip(values, -params.clip, params.clip), omega * factor,
                    out=full[:-1])
    full[-1] = omega * params.clip
    return quantise(full, clip=params.clip, bits=params.bits, n_max=n_max, rng=rng)


def decode_sum(total: RingVector, *, count: int, params: SecAggParams,
               n_max: int) -> npt.NDArray[np.float32]:
    """The float sum of the weighted updates and, last, of the weights (times ``clip``)."""
    return dequantise(total, count=count, clip=params.clip, bits=params.bits, n_max=n_max)


def decode_weighted(total: RingVector, *, count: int, params: SecAggParams,
                    n_max: int) -> tuple[npt.NDArray[np.float32], float]:
    """The weighted mean and the total weight (sum of omegas) from the unmasked ring sum of
    ``count`` clients. ``ValueError`` for a sum no ``count`` honest clients can produce."""
    summed = dequantise(total, count=count, clip=params.clip, bits=params.bits, n_max=n_max)
    weight = float(summed[-1]) / params.clip
    step = FieldSpec(bits=params.bits, clip=params.clip, n_max=n_max).step
    if not weight > 0.5 * step / params.clip:
        raise ValueError(f"the unmasked total weight is {weight:g}: no client contributed")
    mean = (summed[:-1].astype(np.float64) / weight).astype(np.float32)
    return mean, weight


def to_wire(values: RingVector, params: SecAggParams) -> bytes:
    """Ring elements as little-endian words of :attr:`SecAggParams.word_bytes` bytes."""
    return np.asarray(values, dtype=np.uint64).astype("<u4" if params.word_bytes == 4
                                                       else "<u8").tobytes()


def from_wire(payload: bytes | bytearray | memoryview, params: SecAggParams,
              length: int) -> RingVector:
    """Parse a masked input; ``ValueError`` for a wrong length or a value outside the ring."""
    return wire_words(payload, params, length).astype(np.uint64)


def wire_words(payload: bytes | bytearray | memoryview, params: SecAggParams,
               length: int) -> npt.NDArray[np.uint32] | npt.NDArray[np.uint64]:
    """:func:`from_wire` without the widening copy: a read-only view of the payload's words
    (``uint32`` for rings of up to 32 bits). Sums of them in that dtype wrap modulo ``2**32``
    or ``2**64``, which ``2**bits`` divides, so a server adds inputs in it and reduces once."""
    if len(payload) != length * params.word_bytes:
        raise ValueError(f"a masked input of {length} values has {length * params.word_bytes} "
                         f"bytes, got {len(payload)}")
    words = np.frombuffer(payload, dtype="<u4" if params.word_bytes == 4 else "<u8")
    if params.bits not in (32, 64) and words.size and int(words.max()) >> params.bits:
        raise ValueError(f"the masked input holds values outside the ring Z_2**{params.bits}")
    return words


__all__ = ["RING_CODECS", "SecAggParams", "decode_sum", "decode_weighted", "encode_weighted",
           "from_wire", "to_wire", "wire_words"]
