"""A counter-based Rademacher generator that gives bit-identical streams on every device.

Seed-based update codecs (MeZO-style zeroth-order steps, seeded projections) only work if the
client and the server rebuild *exactly* the same random directions: the client may train on a
GPU while the server replays on a CPU, and a single differing bit would let the two models drift
apart. Library generators (``torch.Generator``, NumPy's ``Generator``) promise no such thing across
devices or versions, so this module defines its own stream from integer arithmetic only.

Value ``i`` of stream ``seed`` is bit ``i % 32`` of the 32-bit word ``word(seed, i // 32)``,
mapped to ``+1.0`` for a 0 bit and ``-1.0`` for a 1 bit. A word is a keyed two-round integer
hash of its index, so any slice of the stream can be produced without the values before it
(``offset``), in any block size, in any order. One hash yields 32 values, which is why the
generator runs at several hundred million values per second on a laptop CPU. The exact algorithm,
constants and test vectors are in ``docs/seed-prng.md``.

Why every backend agrees: all intermediate values are non-negative integers below ``2**63`` held
in ``int64`` tensors, masked back to 32 bits after every multiplication, so neither signed
overflow nor arithmetic-versus-logical right shifts can differ between CPU, CUDA or MPS kernels.
Only ``add``/``mul``/``xor``/``and``/``shift`` and a table lookup are used; the table holds
exactly representable ``+-1.0`` values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "MAX_STREAM_LENGTH",
    "check_seed",
    "derive_seed",
    "hash_words",
    "hash_words_into",
    "hash_words_reference",
    "iter_rademacher",
    "rademacher",
    "rademacher_rows",
    "rademacher_reference",
    "splitmix64",
    "stream_keys",
]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
#: Multipliers of Chris Wellons' "lowbias32" integer hash (public-domain constants).
_C1 = 0x7FEB352D  # < 2**31: x * _C1 < 2**63 for any 32-bit x
_C2 = 0x846CA68B  # >= 2**31: multiplied as (x * (_C2 - 2**31) + ((x & 1) << 31)) mod 2**32
_C2_LOW = _C2 - (1 << 31)
#: Word indices are 32-bit, so a stream holds 2**32 words of 32 values.
MAX_STREAM_LENGTH = 32 << 32
_DEFAULT_BLOCK = 1 << 20
_CHUNK_WORDS = 1 << 15
#: :func:`rademacher_rows` on an accelerator: words hashed per pass, over all rows.
_DEVICE_PASS_WORDS = 1 << 22

# Row b, column e holds the value of bit e of byte b: +1.0 for a 0 bit, -1.0 for a 1 bit.
_TABLE_CPU = torch.tensor(
    [[1.0 - 2.0 * ((b >> e) & 1) for e in range(8)] for b in range(256)], dtype=torch.float32
)
_TABLE_NP = _TABLE_CPU.numpy()
_BYTE_SHIFTS_CPU = torch.tensor([0, 8, 16, 24], dtype=torch.int64)
_DEVICE_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def splitmix64(x: int) -> int:
    """Steele, Lea and Flood's SplitMix64 finaliser on a 64-bit integer (a bijection).

    Used only on scalars, in Python integers, so it is exact everywhere.
    """
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def check_seed(seed: int) -> int:
    """``seed`` as a Python int in [0, 2**64); TypeError or ValueError otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    value = int(seed)
    if not 0 <= value <= _M64:
        raise ValueError(f"seed must lie in [0, 2**64), got {value}")
    return value


def stream_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of stream ``seed``: low and high half of ``splitmix64(seed)``.

    SplitMix64 is a bijection, so distinct seeds always give distinct key pairs.
    """
    mixed = splitmix64(check_seed(seed))
    return mixed & _M32, mixed >> 32


def derive_seed(seed: int, index: int) -> int:
    """A 64-bit child seed, one stream per step or round: ``splitmix64(splitmix64(seed) ^ i)``."""
    return splitmix64(splitmix64(check_seed(seed)) ^ (check_seed(index)))


def _check_range(size: int, offset: int) -> None:
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if offset + size > MAX_STREAM_LENGTH:
        raise ValueError(f"offset + size = {offset + size} exceeds the stream length 2**37")


# -- torch --------------------------------------------------------------------------------------


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place, on 32-bit values held in int64; intermediates stay in [0, 2**63)."""
    x ^= x >> 16
    x *= _C1
    x &= _M32
    x ^= x >> 15
    top = (x & 1) << 31
    x *= _C2_LOW
    x += top
    x &= _M32
    x ^= x >> 16
    return x


def _words_torch(k0: int, k1: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    x = torch.arange(first, first + count, dtype=torch.int64, device=device)
    x ^= k0
    x = _mix_torch(x)
    x ^= k1
    return _mix_torch(x)


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    cached = _DEVICE_CONSTANTS.get(device)
    if cached is None:
        cached = (_TABLE_CPU.to(device), _BYTE_SHIFTS_CPU.to(device))
        _DEVICE_CONSTANTS[device] = cached
    return cached


def _resolve(device: torch.device | str | None) -> torch.device:
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def hash_words(
    seed: int, count: int, *, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Words ``offset .. offset+count-1`` of stream ``seed`` as int64 tensors in [0, 2**32)."""
    if count < 0 or offset < 0 or offset + count > (1 << 32):
        raise ValueError(f"word range [{offset}, {offset + count}) is outside [0, 2**32)")
    k0, k1 = stream_keys(seed)
    return _words_torch(k0, k1, offset, count, _resolve(device))


def rademacher(
    seed: int, size: int, *, device: torch.device | str | None = None, offset: int = 0
) -> torch.Tensor:
    """Values ``offset .. offset+size-1`` of stream ``seed``: a float32 tensor of exact +-1.0.

    The result does not depend on ``device`` or on how a caller splits the range into calls.
    """
    seed = check_seed(seed)
    _check_range(size, offset)
    dev = _resolve(device)
    if size == 0:
        return torch.empty(0, dtype=torch.float32, device=dev)
    k0, k1 = stream_keys(seed)
    first, last = offset >> 5, (offset + size - 1) >> 5
    total = last - first + 1
    table, shifts = _constants(dev)
    values = torch.empty(total * 32, dtype=torch.float32, device=dev)
    # Hash and expand a few thousand words at a time: the int64 temporaries then stay in cache,
    # which is about 3x faster on CPU than expanding ten million values in one go.
    for start in range(0, total, _CHUNK_WORDS):
        count = min(_CHUNK_WORDS, total - start)
        words = _words_torch(k0, k1, first + start, count, dev)
        byte_index = ((words.unsqueeze(1) >> shifts) & 0xFF).reshape(-1)
        target = values[start * 32 : (start + count) * 32].view(-1, 8)
        torch.index_select(table, 0, byte_index, out=target)
    skip = offset & 31
    if skip == 0 and total * 32 == size:
        return values
    return values[skip : skip + size]


def rademacher_rows(
    seeds: Sequence[int], size: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Values ``0 .. size-1`` of each stream in ``seeds``: a ``(len(seeds), size)`` float32
    tensor whose row ``i`` is ``rademacher(seeds[i], size)`` bit for bit.

    One set of tensor operations draws every row (the same integer arithmetic, broadcast over
    the seeds' keys), so a batch of clients taking zeroth-order steps together (the vectorised
    simulator) pays a few kernel launches per step, not a few per client.
    """
    dev = _resolve(device)
    rows = len(seeds)
    _check_range(size, 0)
    out = torch.empty(rows, size, dtype=torch.float32, device=dev)
    if rows == 0 or size == 0:
        return out
    keys = [stream_keys(s) for s in seeds]
    k0 = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=dev).unsqueeze(1)
    k1 = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=dev).unsqueeze(1)
    table, shifts = _constants(dev)
    total = (size + 31) >> 5
    # Words per pass: on a CPU, the (rows, words) int64 temporaries stay about cache-sized;
    # on an accelerator, few enough passes that kernel launches don't dominate.
    budget = _CHUNK_WORDS if dev.type == "cpu" else _DEVICE_PASS_WORDS
    step = max(1, min(total, budget // rows))
    for first in range(0, total, step):
        count = min(step, total - first)
        x = torch.arange(first, first + count, dtype=torch.int64, device=dev).unsqueeze(0) ^ k0
        x = _mix_torch(x)
        x ^= k1
        x = _mix_torch(x)
        byte_index = ((x.unsqueeze(2) >> shifts) & 0xFF).reshape(-1)
        values = torch.index_select(table, 0, byte_index).view(rows, count * 32)
        stop = min(size, (first + count) * 32)
        out[:, first * 32 : stop] = values[:, : stop - first * 32]
    return out


def iter_rademacher(
    seed: int,
    size: int,
    *,
    block: int = _DEFAULT_BLOCK,
    device: torch.device | str | None = None,
    offset: int = 0,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(start, values)`` covering ``size`` values of the stream, ``block`` at a time.

    ``start`` is relative to ``offset``. Lets callers walk a model-sized stream while holding at
    most one block; round ``block`` to a multiple of 32 to avoid hashing a word twice.
    """
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    _check_range(size, offset)
    for start in range(0, size, block):
        count = min(block, size - start)
        yield start, rademacher(seed, count, device=device, offset=offset + start)


# -- NumPy reference ------------------------------------------------------------------------------


def _mix_numpy(x: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """lowbias32 with NumPy's wrapping uint32 arithmetic (independent of the int64 trick)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_C1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_C2)
    return x ^ (x >> np.uint32(16))


def hash_words_reference(seed: int, count: int, *, offset: int = 0) -> npt.NDArray[np.uint32]:
    """NumPy twin of :func:`hash_words` (uint32 result), used to cross-check the torch code."""
    if count < 0 or offset < 0 or offset + count > (1 << 32):
        raise ValueError(f"word range [{offset}, {offset + count}) is outside [0, 2**32)")
    k0, k1 = stream_keys(seed)
    index = np.arange(offset, offset + count, dtype=np.uint64).astype(np.uint32)
    return _mix_numpy(_mix_numpy(index ^ np.uint32(k0)) ^ np.uint32(k1))


def _mix_numpy_inplace(x: npt.NDArray[np.uint32], tmp: npt.NDArray[np.uint32]) -> None:
    """:func:`_mix_numpy` in place: no temporaries, so a block of words stays in cache."""
    np.right_shift(x, np.uint32(16), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(_C1), out=x)
    np.right_shift(x, np.uint32(15), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(_C2), out=x)
    np.right_shift(x, np.uint32(16), out=tmp)
    np.bitwise_xor(x, tmp, out=x)


def hash_words_into(keys: tuple[int, int], first: int, out: npt.NDArray[np.uint32],
                    tmp: npt.NDArray[np.uint32], counter: npt.NDArray[np.uint32]) -> None:
    """Words ``first .. first+len(out)-1`` of the stream with ``keys`` (:func:`stream_keys`)
    written into ``out``, with :func:`hash_words_reference`'s wrapping uint32 arithmetic.

    The CPU replay kernel's generator: ``tmp`` (scratch) and ``counter`` (``arange`` of at
    least ``len(out)`` uint32) are the caller's reused buffers, so hashing a block allocates
    nothing. About 4x fewer CPU-seconds than the int64 torch twin, which exists for devices.
    """
    count = out.size
    if first < 0 or first + count > (1 << 32):
        raise ValueError(f"word range [{first}, {first + count}) is outside [0, 2**32)")
    np.add(counter[:count], np.uint32(first), out=out)
    np.bitwise_xor(out, np.uint32(keys[0]), out=out)
    _mix_numpy_inplace(out, tmp[:count])
    np.bitwise_xor(out, np.uint32(keys[1]), out=out)
    _mix_numpy_inplace(out, tmp[:count])


def rademacher_reference(seed: int, size: int, *, offset: int = 0) -> npt.NDArray[np.float32]:
    """NumPy twin of :func:`rademacher`; also the fastest path for NumPy-only callers on CPU."""
    seed = check_seed(seed)
    _check_range(size, offset)
    if size == 0:
        return np.empty(0, dtype=np.float32)
    first, last = offset >> 5, (offset + size - 1) >> 5
    words = hash_words_reference(seed, last - first + 1, offset=first)
    # Bytes in little-endian order regardless of the host: byte q of a word is bits 8q..8q+7.
    byte_index = words.astype("<u4").view(np.uint8)
    values = _TABLE_NP[byte_index].reshape(-1)
    skip = offset & 31
    return values[skip : skip + size]
