"""The ``seed`` codec: a zeroth-order client's step log on the wire (MeZO steps, FedKSeed pools).

A zeroth-order client sends, instead of its model delta, the recipe: a seed and a scalar ``g``
per local step, which the server replays exactly on the model the client started from (the
arithmetic, and why it is bit-exact, is in :mod:`murmura.protocols.codecs.seed_steps`;
FedKSeed's shared seed pool in :mod:`murmura.protocols.codecs.seed_pool`). This module is the
wire format (:class:`SeedCodec`: pack, parse and validate, decode by replay) and the client's
side of it (:class:`SeedEncoder`: round ``g`` to what the wire carries, apply and log each
step). The step and pool functions are re-exported here, where callers import them.

Wire layout (little-endian): the 4-byte codec header (flags: bit 0 int8 scalars, bit 1 64-bit
seeds, bit 2 pool seeds), then ``lr: float32``, ``steps: uint32``, ``gscale: float32`` (the int8
step, 0 for float16), then ``steps`` seeds (uint32 or uint64), then ``steps`` scalars (float16,
or int8 in [-127, 127] meaning ``q * gscale``). 200 steps with 32-bit seeds and float16 scalars
take 1216 bytes, whatever the model size.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols import prng
from murmura.protocols.codecs._util import (
    F16_MAX,
    HEADER_BYTES,
    check_header,
    check_size,
    pack_header,
    parse_choice,
)
from murmura.protocols.codecs.base import (
    Codec,
    CodecError,
    Encoder,
    FlatVector,
    check_payload_length,
    parse_float_option,
    parse_int_option,
    register_codec,
    reject_leftover_options,
)
from murmura.protocols.codecs.seed_pool import SeedPool, apply_pool, pool_model
from murmura.protocols.codecs.seed_steps import (
    APPLY_BLOCK,
    BlockDraw,
    ZOSteps,
    apply_step,
    apply_steps,
    check_theta,
    replay,
    step_coefficient,
    zo_gradient,
)

__all__ = [
    "APPLY_BLOCK",
    "BlockDraw",
    "SeedCodec",
    "SeedEncoder",
    "SeedPool",
    "ZOSteps",
    "apply_pool",
    "apply_step",
    "apply_steps",
    "pool_model",
    "replay",
    "step_coefficient",
    "zo_gradient",
]

_TAG = ord("z")
_FIELDS = struct.Struct("<fIf")  # lr, number of steps, gscale
_FLAG_INT8, _FLAG_SEED64, _FLAG_POOL = 1, 2, 4
#: Stream index of the pool's base seed under the run seed (``derive_seed(run_seed, _POOL)``).
_POOL_STREAM = 0x706F6F6C  # "pool"
#: Without ``gclip`` an int8 payload clips g at this multiple of the first non-zero |g|.
_GCLIP_HEADROOM = 4.0


@register_codec
class SeedCodec(Codec):
    """A zeroth-order step log: ``(seed, g)`` per step, replayed by the server.

    Options: ``dtype`` = ``fp16`` (default) or ``int8`` (with a float32 step in the header),
    ``seed_bits`` = ``32`` (default) or ``64``, ``max_steps`` (default 1024, the most steps a
    payload may carry), ``gclip`` (int8 only: g is clipped to +-gclip; default 4x the first
    non-zero |g| of the payload), ``pool`` (default 0: off; K > 0 draws every step seed from
    FedKSeed's shared pool of K seeds, see :class:`SeedPool`, so the server can aggregate in K
    pool coordinates and a client can catch up by downloading K scalars instead of the model),
    ``q`` (default 1: perturbations per batch; q > 1 is MeZO's n-SPSA: q directions on the same
    batch, each logged as its own step with ``g / q``, so the log holds q entries per batch and
    the model moves by the mean of the q estimates, applied one after another).
    Payload: 16 + steps * (seed bytes + scalar bytes) bytes.
    """

    name = "seed"
    needs_reference = True

    def __init__(self, **options: str) -> None:
        opts = dict(options)
        self.int8 = parse_choice(self.name, opts, "dtype", "fp16", {"fp16": False, "int8": True})
        self.seed_bits = parse_choice(self.name, opts, "seed_bits", "32", {"32": 32, "64": 64})
        self.max_steps = parse_int_option(self.name, opts, "max_steps", 1024, low=1, high=1 << 20)
        self.pool_size = parse_int_option(self.name, opts, "pool", 0, low=0, high=1 << 16)
        self.q = parse_int_option(self.name, opts, "q", 1, low=1, high=64)
        has_gclip = "gclip" in opts
        gclip = parse_float_option(self.name, opts, "gclip", 0.0, low=1e-30, high=1e30)
        if has_gclip and not self.int8:
            raise CodecError(f"codec {self.name!r}: option gclip only applies to dtype=int8")
        self.gclip: float | None = gclip if has_gclip else None
        reject_leftover_options(self.name, opts)
        self._flags = ((_FLAG_INT8 if self.int8 else 0) | (_FLAG_SEED64 if self.seed_bits == 64
                                                          else 0)
                       | (_FLAG_POOL if self.pool_size else 0))
        self._seed_dtype = np.dtype("<u8" if self.seed_bits == 64 else "<u4")
        self._g_dtype = np.dtype("i1" if self.int8 else "<f2")

    def pool(self, run_seed: int) -> SeedPool | None:
        """The run's shared seed pool when option ``pool`` is set, else None.

        Both peers derive it from the run seed (``TaskSettings.seed``), so it never travels.
        """
        if not self.pool_size:
            return None
        return _cached_pool(self.pool_size, prng.derive_seed(run_seed, _POOL_STREAM),
                            self.seed_bits)

    def _step_bytes(self) -> int:
        return self._seed_dtype.itemsize + self._g_dtype.itemsize

    def payload_bytes(self, steps: int) -> int:
        """Exact payload size for ``steps`` steps (independent of the model size)."""
        return HEADER_BYTES + _FIELDS.size + steps * self._step_bytes()

    def max_payload_bytes(self, size: int) -> int:
        check_size(self.name, size)
        return self.payload_bytes(self.max_steps)

    def encoder(self, size: int, *, seed: int = 0) -> SeedEncoder:
        check_size(self.name, size)
        return SeedEncoder(self, size, seed)

    def pack(self, steps: ZOSteps, codes: npt.NDArray[np.int8] | None = None) -> bytes:
        """Serialise a step log; int8 payloads pass their codes (``grads = codes * gscale``)."""
        if len(steps) > self.max_steps:
            raise CodecError(f"codec {self.name!r}: {len(steps)} steps exceed max_steps="
                             f"{self.max_steps}")
        if self.int8:
            if codes is None or codes.shape != steps.seeds.shape:
                raise ValueError("int8 payloads need one code per step")
            scalars = codes.astype(np.int8).tobytes()
        else:
            scalars = steps.grads.astype("<f2").tobytes()
        return (pack_header(_TAG, self._flags)
                + _FIELDS.pack(steps.lr, len(steps), steps.gscale)
                + steps.seeds.astype(self._seed_dtype).tobytes() + scalars)

    def unpack(self, payload: bytes | memoryview) -> ZOSteps:
        """Parse and validate an untrusted step log."""
        check_header(self.name, payload, tag=_TAG, flags=self._flags)
        if len(payload) < HEADER_BYTES + _FIELDS.size:
            raise CodecError(f"codec {self.name!r}: payload is {len(payload)} bytes, shorter than "
                             f"the {HEADER_BYTES + _FIELDS.size}-byte header")
        lr, count, gscale = _FIELDS.unpack_from(payload, HEADER_BYTES)
        if count > self.max_steps:
            raise CodecError(f"codec {self.name!r}: {count} steps exceed max_steps="
                             f"{self.max_steps}")
        check_payload_length(self.name, payload, self.payload_bytes(count))
        if not (np.isfinite(lr) and lr >= 0 and (lr > 0 or count == 0)):
            raise CodecError(f"codec {self.name!r}: learning rate {lr} must be finite and "
                             "positive")
        if self.int8 and not (np.isfinite(gscale) and gscale > 0):
            raise CodecError(f"codec {self.name!r}: int8 step {gscale} must be finite and "
                             "positive")
        if not self.int8 and gscale != 0:
            raise CodecError(f"codec {self.name!r}: gscale must be 0 for float16 scalars, got "
                             f"{gscale}")
        offset = HEADER_BYTES + _FIELDS.size
        seeds = np.frombuffer(payload, dtype=self._seed_dtype, count=count, offset=offset)
        offset += count * self._seed_dtype.itemsize
        raw = np.frombuffer(payload, dtype=self._g_dtype, count=count, offset=offset)
        if self.int8:
            if count and int(raw.min()) < -127:
                bad = int(np.argmin(raw))
                raise CodecError(f"codec {self.name!r}: int8 scalar of step {bad} is -128, "
                                 "outside [-127, 127]")
            grads = _dequantize_int8(raw, gscale)
        else:
            grads = raw.astype(np.float32)
            finite = np.isfinite(grads)
            if not finite.all():
                bad = int(np.argmin(finite))
                raise CodecError(f"codec {self.name!r}: scalar of step {bad} is {grads[bad]}")
        steps = ZOSteps(float(lr), seeds.astype(np.uint64), grads, float(gscale))
        if not np.isfinite(steps.coefficients).all():
            raise CodecError(f"codec {self.name!r}: lr * g overflows float32")
        return steps

    def decode(self, payload: bytes | memoryview, size: int, *,
               reference: FlatVector | None = None) -> FlatVector:
        check_size(self.name, size)
        return self.decode_into(payload, np.empty(size, dtype=np.float32), reference=reference)

    def decode_into(self, payload: bytes | memoryview, out: FlatVector, *,
                    reference: FlatVector | None = None) -> FlatVector:
        """The replayed model minus ``reference``, built in ``out`` (no model-sized temporary:
        :func:`replay` into ``out``, then the subtraction in place)."""
        size = out.size
        check_size(self.name, size)
        if reference is None:
            raise CodecError(f"codec {self.name!r}: decoding needs the reference model the "
                             "client started from")
        if reference.shape != (size,):
            raise CodecError(f"codec {self.name!r}: reference has shape {reference.shape}, "
                             f"expected ({size},)")
        steps = self.unpack(payload)
        np.copyto(out, reference)
        apply_steps(torch.from_numpy(out), steps.seeds, steps.coefficients)
        np.subtract(out, reference, out=out)
        return out


def _dequantize_int8(codes: npt.NDArray[np.int8], gscale: float) -> npt.NDArray[np.float32]:
    """``float32(code) * float32(gscale)``, one rounding; shared by the client and the server."""
    return np.multiply(codes.astype(np.float32), np.float32(gscale), dtype=np.float32)


class SeedEncoder(Encoder):
    """Applies a client's zeroth-order steps and records them for the next payload.

    Typical use, one round::

        enc = codec.encoder(size, seed=client_seed)
        for _ in range(local_steps):
            s = enc.next_seed()                 # or pool.sample(rng) for FedKSeed
            g = zo_gradient(loss, theta, seed=s, eps=1e-3)
            enc.step(theta, seed=s, g=g, lr=lr) # theta <- theta - lr * g_wire * z(s)
        payload = enc.encode(spec.flatten(model) - global_vector)  # the update is not sent
    """

    def __init__(self, codec: SeedCodec, size: int, seed: int) -> None:
        self._codec, self._size = codec, size
        self._stream, self._drawn = prng.check_seed(seed), 0
        self._clear()
        #: How many recorded g were clipped to fit the wire format (diagnostics).
        self.clipped = 0

    def _clear(self) -> None:
        self._seeds: list[int] = []
        self._grads: list[np.float32] = []
        self._codes: list[int] = []
        self._lr: np.float32 | None = None
        self._gscale: np.float32 | None = (
            np.float32(self._codec.gclip / 127) if self._codec.gclip is not None else None)

    @property
    def pending_steps(self) -> int:
        return len(self._seeds)

    def next_seed(self) -> int:
        """A fresh per-step seed from this encoder's stream, narrowed to the wire width."""
        seed = prng.derive_seed(self._stream, self._drawn)
        self._drawn += 1
        return seed & ((1 << self._codec.seed_bits) - 1)

    def _quantize(self, g: float) -> tuple[np.float32, int]:
        """The value of g the wire can carry, and its int8 code (0 for float16)."""
        if not self._codec.int8:
            clipped = min(max(g, -F16_MAX), F16_MAX)
            self.clipped += clipped != g
            return np.float32(np.float16(clipped)), 0
        if self._gscale is None:
            if g == 0:
                return np.float32(0), 0
            self._gscale = np.float32(_GCLIP_HEADROOM * abs(g) / 127)
            if not (np.isfinite(self._gscale) and self._gscale > 0):
                raise ValueError(f"g = {g} cannot set an int8 scale")
        q = round(g / float(self._gscale))
        code = int(min(max(q, -127), 127))
        self.clipped += code != q
        return _dequantize_int8(np.array([code], dtype=np.int8), float(self._gscale))[0], code

    def step(self, theta: torch.Tensor, *, seed: int, g: float, lr: float) -> np.float32:
        """Take one step ``theta <- theta - lr * g * z(seed)`` exactly as the server will replay it.

        Returns the float32 coefficient that was applied. ``lr`` must stay the same within one
        payload (the header carries one).
        """
        check_theta(theta)
        if theta.numel() != self._size:
            raise ValueError(f"theta has {theta.numel()} values, expected {self._size}")
        coeff = self.record(seed=seed, g=g, lr=lr)
        apply_step(theta, seed, coeff)
        return coeff

    def record(self, *, seed: int, g: float, lr: float) -> np.float32:
        """Log a step without applying it; returns its float32 coefficient. For a trainer that
        folds the step into a pass it makes anyway (it must rebuild its model from the log, as
        the server does, before it uses it: see ``ZOTrainer.train``)."""
        if len(self._seeds) >= self._codec.max_steps:
            raise ValueError(f"a payload holds at most max_steps={self._codec.max_steps} steps")
        if not 0 <= seed < (1 << self._codec.seed_bits):
            raise ValueError(f"seed {seed} does not fit in {self._codec.seed_bits} bits")
        if not np.isfinite(g):
            raise ValueError(f"g = {g} is not finite; skip this step")
        lr32 = np.float32(lr)
        if not (np.isfinite(lr32) and lr32 > 0):
            raise ValueError(f"lr must be positive and finite, got {lr}")
        if self._lr is not None and lr32 != self._lr:
            raise ValueError(f"lr changed from {self._lr} to {lr32} within one payload")
        self._lr = lr32
        applied, code = self._quantize(float(g))
        coeff = np.float32(step_coefficient(float(lr32), applied))
        self._seeds.append(int(seed))
        self._grads.append(applied)
        self._codes.append(code)
        return coeff

    def steps(self) -> ZOSteps:
        """The steps recorded since the last :meth:`encode`, as the server will decode them."""
        gscale = float(self._gscale) if (self._codec.int8 and self._gscale is not None) else 0.0
        if self._codec.int8 and gscale == 0.0:
            gscale = 1.0  # only zero codes so far: any positive step decodes them to 0
        return ZOSteps(float(self._lr) if self._lr is not None else 0.0,
                       np.asarray(self._seeds, dtype=np.uint64),
                       np.asarray(self._grads, dtype=np.float32), gscale)

    def encode(self, update: FlatVector) -> bytes:
        """Serialise the recorded steps and start a new log; ``update`` is only shape-checked."""
        if update.shape != (self._size,):
            raise CodecError(f"codec {self._codec.name!r}: update has shape {update.shape}, "
                             f"expected ({self._size},)")
        payload = self._codec.pack(self.steps(), np.asarray(self._codes, dtype=np.int8))
        self._clear()
        return payload


@functools.lru_cache(maxsize=8)
def _cached_pool(k: int, base_seed: int, seed_bits: int) -> SeedPool:
    return SeedPool(k, base_seed, seed_bits=seed_bits)
