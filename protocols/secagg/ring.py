"""Fixed-point encoding of updates into the ring ``Z_{2**bits}`` that masks live in."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: Ring elements: values in ``[0, 2**bits)`` held in ``uint64``.
RingVector = npt.NDArray[np.uint64]

#: Quantisation levels stay below ``2**52`` so that ``value * scale`` and the clamp to the level
#: range are exact in float64 for every ring width up to 64 bits.
_MAX_LEVELS = 1 << 52

# --------------------------------------------------------------------------------------------
# Fixed-point encoding
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldSpec:
    """Fixed-point encoding of values in ``[-clip, clip]`` into the ring ``Z_{2**bits}``.

    Each value is mapped to an integer level ``q`` in ``[-levels, levels]`` with
    ``step = clip / levels`` and stored as ``q mod 2**bits``. A sum of ``n <= n_max`` encodings is
    a level in ``[-n_max * levels, n_max * levels]``, and the signed reading of the ring (values at
    or above ``2**(bits - 1)`` are negative) recovers it exactly as long as::

        2 * n_max * levels < 2**bits,   i.e.   levels = floor((2**(bits - 1) - 1) / n_max)

    which is how ``levels`` is chosen (capped at ``2**52``, beyond which float32 updates gain
    nothing and float64 arithmetic would stop being exact). Parameters that leave fewer than one
    level raise ``ValueError``: overflow of the sum is then impossible by construction, not by luck.
    """

    bits: int
    clip: float
    n_max: int

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 64:
            raise ValueError(f"bits must be in [2, 64], got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be finite and positive, got {self.clip}")
        if self.n_max < 1:
            raise ValueError(f"n_max must be at least 1, got {self.n_max}")
        if ((1 << (self.bits - 1)) - 1) // self.n_max < 1:
            raise ValueError(
                f"a {self.bits}-bit ring cannot hold the sum of {self.n_max} clients: "
                f"2 * n_max * levels < 2**bits leaves no level; use more bits or fewer clients"
            )

    @property
    def modulus(self) -> int:
        """The ring size ``2**bits``."""
        return 1 << self.bits

    @property
    def levels(self) -> int:
        """The largest level magnitude of one client: ``clip`` encodes as ``levels``."""
        return min(((1 << (self.bits - 1)) - 1) // self.n_max, _MAX_LEVELS)

    @property
    def step(self) -> float:
        """The quantisation step ``clip / levels``: the error bound of one stochastic rounding."""
        return self.clip / self.levels


def _reduce(values: RingVector, bits: int) -> RingVector:
    if bits == 64:
        return values
    return values & np.uint64((1 << bits) - 1)


def _check_ring(values: RingVector, bits: int, what: str) -> RingVector:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype != np.uint64:
        raise ValueError(f"{what} must be a 1-D uint64 vector, got {arr.dtype} {arr.shape}")
    if bits < 64 and arr.size and int(arr.max()) >> bits:
        raise ValueError(f"{what} holds values outside the ring Z_2**{bits}")
    return arr


def quantise(
    update: npt.ArrayLike,
    *,
    clip: float,
    bits: int,
    n_max: int,
    rng: np.random.Generator | None = None,
) -> RingVector:
    """Clip a flat update to ``[-clip, clip]`` and encode it into ``Z_{2**bits}``.

    With ``rng`` the rounding is stochastic and unbiased (error below one ``step``); without it,
    round-to-nearest (error at most half a step). See :class:`FieldSpec` for the range inequality.
    Non-finite values are refused: clipping cannot give NaN a meaning.
    """
    spec = FieldSpec(bits=bits, clip=clip, n_max=n_max)
    values = np.asarray(update, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"update must be a flat vector, got shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("update holds NaN or infinite values")
    levels = spec.levels
    scaled = np.clip(values, -clip, clip) * (levels / clip)
    if rng is None:
        rounded = np.rint(scaled)
    else:
        rounded = np.floor(scaled + rng.random(values.shape[0]))
    ints = np.clip(rounded, -levels, levels).astype(np.int64)
    return _reduce(ints.astype(np.uint64), bits)


def dequantise(
    sum_ints: RingVector, *, count: int, clip: float, bits: int, n_max: int
) -> npt.NDArray[np.float32]:
    """Decode the ring sum of ``count`` quantised updates into their float32 sum.

    The sum is within ``count * step`` of the float sum of the clipped inputs (plus float32
    rounding of the result). A level outside ``[-count * levels, count * levels]`` cannot come from
    ``count`` honest encodings and raises ``ValueError``: a wrong unmasking or an out-of-range
    client input is refused rather than decoded into garbage.
    """
    spec = FieldSpec(bits=bits, clip=clip, n_max=n_max)
    if not 0 <= count <= n_max:
        raise ValueError(f"count must be in [0, n_max={n_max}], got {count}")
    ring = _check_ring(sum_ints, bits, "sum_ints")
    if bits == 64:
        signed = ring.view(np.int64)
    else:
        signed = ring.astype(np.int64)
        signed = np.where(signed >= (1 << (bits - 1)), signed - (1 << bits), signed)
    bound = count * spec.levels
    if signed.size and (int(signed.max()) > bound or int(signed.min()) < -bound):
        raise ValueError(f"sum out of range for {count} clients: corrupted unmasking or input")
    return (signed.astype(np.float64) * spec.step).astype(np.float32)
