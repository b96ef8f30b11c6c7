"""Helpers shared by the compressed codecs: the 4-byte header, option parsing, payload readers.

Every compressed payload starts with ``magic, tag, version, flags`` (one byte each). The sizes of
everything after it follow from the vector size and the codec options, which both peers know,
so the header costs 4 bytes and buys a precise error when a payload was produced by another codec,
another format version or other options, instead of garbage that happens to have the right length.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols.codecs.base import CodecError, FlatVector

T = TypeVar("T")

MAGIC = 0xB5
FORMAT_VERSION = 1
HEADER = struct.Struct("<BBBB")
HEADER_BYTES = HEADER.size

#: Scale or value dtypes selectable with ``scale=`` / ``values=``, little-endian on the wire.
FLOAT_DTYPES: dict[str, np.dtype[np.floating]] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
F16_MAX = float(np.finfo(np.float16).max)


#: Torch runs an elementwise op on one thread below this many elements anyway (ATen's grain
#: size), so smaller work skips the toggle.
TORCH_GRAIN = 32_768


class _OneTorchThread:
    """The process-wide state behind :func:`one_torch_thread` (one instance)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved = 1

    def __enter__(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = torch.get_num_threads()
                if self.saved != 1:
                    torch.set_num_threads(1)
            self.depth += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.saved != 1:
                torch.set_num_threads(self.saved)


_ONE_THREAD = _OneTorchThread()
_NOTHING = contextlib.nullcontext()


def one_torch_thread(elements: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Torch's intra-op threads lowered to one for the block.

    Memory-bound ops on cache-sized blocks (a decoder's, the fold's) run fastest on one core: a
    second OpenMP thread adds a synchronisation per op that stalls whenever another process
    holds the other core. Torch's thread count is process-wide, so while any thread is inside
    this block every torch op in the process runs on one thread. The block is re-entrant and
    thread-safe: the first thread in lowers the count and the last one out restores it (a
    save/restore per caller would let two overlapping callers restore each other's lowered
    count and leave the process at one thread for good). This is the only place in the
    library that changes the count temporarily; a pure aggregation rule never does.

    ``elements``: the size of the work, when known; below :data:`TORCH_GRAIN` torch uses one
    thread by itself and nothing is changed.
    """
    if elements is not None and elements < TORCH_GRAIN:
        return _NOTHING
    return _ONE_THREAD


def pack_header(tag: int, flags: int) -> bytes:
    return HEADER.pack(MAGIC, tag, FORMAT_VERSION, flags)


def check_header(codec: str, payload: bytes | memoryview, *, tag: int, flags: int) -> None:
    """Validate the 4-byte header; ``flags`` are the bits the decoder's own options imply."""
    if len(payload) < HEADER_BYTES:
        raise CodecError(f"codec {codec!r}: payload is {len(payload)} bytes, shorter than the "
                         f"{HEADER_BYTES}-byte header")
    magic, got_tag, version, got_flags = HEADER.unpack_from(payload, 0)
    if magic != MAGIC:
        raise CodecError(f"codec {codec!r}: bad header magic 0x{magic:02x} "
                         f"(expected 0x{MAGIC:02x})")
    if got_tag != tag:
        raise CodecError(f"codec {codec!r}: payload was encoded by another codec "
                         f"(tag {chr(got_tag)!r}, expected {chr(tag)!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"codec {codec!r}: unsupported format version {version} "
                         f"(this build reads {FORMAT_VERSION})")
    if got_flags != flags:
        raise CodecError(f"codec {codec!r}: header flags 0x{got_flags:02x} do not match this "
                         f"codec's options (expected 0x{flags:02x}); were the options changed?")


def parse_choice(codec: str, options: dict[str, str], key: str, default: str,
                 choices: Mapping[str, T]) -> T:
    """Pop ``key`` from options as one of ``choices`` (by name)."""
    raw = options.pop(key, default)
    if raw not in choices:
        raise CodecError(f"codec {codec!r}: option {key}={raw!r} must be one of "
                         f"{', '.join(sorted(choices))}")
    return choices[raw]


def parse_flag(codec: str, options: dict[str, str], key: str, default: bool) -> bool:
    """Pop ``key`` as a boolean written ``1/0``, ``true/false``, ``yes/no`` or ``on/off``."""
    raw = options.pop(key, None)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise CodecError(f"codec {codec!r}: option {key}={raw!r} must be 0 or 1")


def check_update(codec: str, update: FlatVector, size: int) -> FlatVector:
    """The update as contiguous float32 (no copy if it already is), else a CodecError saying why."""
    if update.shape != (size,):
        raise CodecError(f"codec {codec!r}: update has shape {update.shape}, expected ({size},)")
    vector = np.ascontiguousarray(update, dtype=np.float32)
    finite = np.isfinite(vector)
    if not finite.all():
        raise CodecError(f"codec {codec!r}: update holds NaN or Inf at index "
                         f"{int(np.argmin(finite))}")
    return vector


def check_size(codec: str, size: int) -> None:
    if size < 0:
        raise CodecError(f"codec {codec!r}: size must be >= 0, got {size}")


def to_wire_floats(codec: str, values: npt.NDArray[np.float32], dtype: np.dtype[np.floating],
                   what: str) -> npt.NDArray[np.floating]:
    """Cast to the wire dtype, refusing values float16 cannot hold instead of sending Inf."""
    if dtype == np.float16 and values.size and float(np.abs(values).max()) > F16_MAX:
        raise CodecError(f"codec {codec!r}: a {what} exceeds the float16 range "
                         f"(|x| > {F16_MAX}); use the f32 option")
    return values.astype(dtype)


def read_floats(codec: str, payload: bytes | memoryview, offset: int, count: int,
                dtype: np.dtype[np.floating], what: str, *,
                nonnegative: bool = False) -> npt.NDArray[np.float32]:
    """Read ``count`` wire floats at ``offset`` as float32; refuse NaN, Inf and (optionally) < 0."""
    raw = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
    values = raw.astype(np.float32)
    finite = np.isfinite(values)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise CodecError(f"codec {codec!r}: {what} {bad} is {values[bad]} (must be finite)")
    if nonnegative and values.size and float(values.min()) < 0:
        bad = int(np.argmin(values))
        raise CodecError(f"codec {codec!r}: {what} {bad} is negative ({values[bad]})")
    return values


def unpack_bits(codec: str, payload: bytes | memoryview, offset: int, nbits: int,
                what: str) -> npt.NDArray[np.uint8]:
    """``nbits`` little-endian bits at byte ``offset``; the padding bits must be zero."""
    nbytes = (nbits + 7) // 8
    packed = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=offset)
    bits = np.unpackbits(packed, bitorder="little")
    if bits[nbits:].any():
        raise CodecError(f"codec {codec!r}: padding bits after the {what} are not zero")
    return bits[:nbits]
