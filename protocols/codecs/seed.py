"""Seed-based zeroth-order updates with exact replay (MeZO steps, FedKSeed seed pools).

Implementation based on MeZO, Malladi et al., "Fine-Tuning Language Models with Just Forward
Passes", https://arxiv.org/abs/2305.17333, and FedKSeed, Qin et al., "Federated Full-Parameter
Tuning of Billion-Sized Language Models with Communication Cost under 18 Kilobytes",
https://arxiv.org/abs/2312.06353.

A zeroth-order client never sends its model delta. It sends the *recipe*: for each local step a
seed and a scalar ``g`` (the projected gradient), and the server rebuilds the client's model by
applying the same steps, in order, to the model the client started from::

    theta <- theta + c_t * z(seed_t)     with  c_t = float32(-(lr * g_t)),  z = rademacher(seed_t)

Replay is exact, bit for bit, on any device: ``z`` is a vector of exact ``+-1.0`` from
:mod:`murmura.protocols.prng`, so ``c_t * z`` is exact (a sign flip) and each coordinate sees a
single correctly rounded float32 addition per step: no fused multiply-add, reduction order or
library kernel can change the result. Both peers call the same :func:`step_coefficient` and
:func:`apply_step`, and the client applies the wire value of ``g`` (after float16 or int8
rounding), never its own unrounded one.

Wire layout (little-endian): the 4-byte codec header (flags: bit 0 int8 scalars, bit 1 64-bit
seeds), then ``lr: float32``, ``steps: uint32``, ``gscale: float32`` (the int8 step, 0 for
float16), then ``steps`` seeds (uint32 or uint64), then ``steps`` scalars (float16, or int8 in
[-127, 127] meaning ``q * gscale``). 200 steps with 32-bit seeds and float16 scalars take 1216
bytes, whatever the model size.
"""

from __future__ import annotations

import functools
import logging
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols import prng
from murmura.protocols.codecs._util import (
    F16_MAX,
    HEADER_BYTES,
    check_header,
    check_size,
    one_torch_thread,
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

__all__ = [
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
#: Values per block when walking a model: big enough to amortise kernel launches, small enough
#: that a block of the model and of z stay in a CPU's L2 cache while every step is applied.
log = logging.getLogger(__name__)

APPLY_BLOCK = 1 << 18
#: Without ``gclip`` an int8 payload clips g at this multiple of the first non-zero |g|.
_GCLIP_HEADROOM = 4.0


# -- the arithmetic both peers share ------------------------------------------------------------


def step_coefficient(lr: float, g: float | npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``float32(-(float32(lr) * float32(g)))``: the exact number a step adds times ``z``.

    Computed once, the same way, on both sides; a NumPy float32 multiply is one IEEE rounding.
    An overflow gives Inf silently; :func:`apply_steps` and the decoder refuse it.
    """
    with np.errstate(over="ignore"):
        product = np.multiply(np.float32(lr), np.asarray(g, dtype=np.float32), dtype=np.float32)
    return np.negative(product, dtype=np.float32)


def _check_theta(theta: torch.Tensor) -> None:
    if theta.dtype != torch.float32 or theta.dim() != 1 or not theta.is_contiguous():
        raise ValueError(f"theta must be a contiguous 1-D float32 tensor, got {theta.dtype} "
                         f"with shape {tuple(theta.shape)}")


def _as_float32(coeff: float | np.floating) -> float:
    value = float(np.float32(coeff))
    if value != float(coeff) or not np.isfinite(value):
        raise ValueError(f"step coefficient {coeff!r} is not a finite float32 value; "
                         "compute it with step_coefficient()")
    return value


def apply_step(theta: torch.Tensor, seed: int, coeff: float | np.floating, *,
               block: int = APPLY_BLOCK) -> None:
    """``theta += coeff * rademacher(seed)`` in place, on theta's device, block by block.

    A zero coefficient is skipped (so ``-0.0`` entries keep their sign on both peers). The
    result is independent of ``block`` and of the device.
    """
    apply_steps(theta, [seed], [coeff], block=block)


def apply_steps(theta: torch.Tensor, seeds: Sequence[int] | npt.NDArray[np.uint64],
                coeffs: npt.NDArray[np.float32] | Sequence[float | np.floating], *,
                block: int = APPLY_BLOCK) -> None:
    """Apply steps ``t = 0, 1, ...`` in order; bit-identical to calling :func:`apply_step` per step.

    The loop runs over blocks of theta outside and steps inside: every coordinate still sees its
    additions in step order, but the block stays in cache, so replaying hundreds of steps costs
    little more than generating their random values. At most one block of ``z`` is alive.
    """
    _check_theta(theta)
    if len(seeds) != len(coeffs):
        raise ValueError(f"{len(seeds)} seeds but {len(coeffs)} coefficients")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    pairs = zip(seeds, coeffs, strict=True)
    steps = [(int(s), _as_float32(c)) for s, c in pairs if float(c) != 0.0]
    if theta.device.type == "cpu" and sys.byteorder == "little":
        _apply_steps_cpu(theta, steps, block)
    elif theta.device.type == "cuda" and _fused_kernel_ready(theta.device):
        from murmura.protocols.codecs import seed_triton

        seed_triton.apply_steps_cuda(theta, [prng.stream_keys(s) for s, _ in steps],
                                     [c for _, c in steps])
    else:
        _apply_steps_device(theta, steps, block)


@functools.lru_cache(maxsize=8)
def _fused_kernel_ready(device: torch.device) -> bool:
    """Whether the one-pass Triton kernel serves ``device``; warns once when it cannot (the
    exact torch path then runs, launch-bound and much slower on a GPU)."""
    from murmura.protocols.codecs import seed_triton

    if seed_triton.available(device):
        return True
    log.warning("triton is not available: seed steps on %s take the exact torch path, which "
                "is much slower on a GPU (pip install triton)", device)
    return False


def _apply_steps_device(theta: torch.Tensor, steps: list[tuple[int, float]], block: int) -> None:
    """:func:`apply_steps` on any device; the CPU kernel must match it bit for bit."""
    size = theta.numel()
    with torch.no_grad():
        for start in range(0, size, block):
            part = theta[start : start + block]
            for seed, coeff in steps:
                z = prng.rademacher(seed, part.numel(), device=theta.device, offset=start)
                part.add_(z.mul_(coeff))  # z * coeff is exact, so this is one rounding


def _apply_steps_cpu(theta: torch.Tensor, steps: list[tuple[int, float]], block: int) -> None:
    """:func:`apply_steps` on CPU, bit-identical to the device loop and about 3x cheaper.

    Per block and step: the stream's words are hashed with wrapping uint32 NumPy arithmetic into
    a reused buffer (:func:`prng.hash_words_into`; the int64 torch hash costs 4x more), and
    each byte of a word selects a row of ``coeff * table``, the 8 values ``+-coeff`` its bits
    stand for, so one ``index_select`` writes ``coeff * z`` (exact: a sign flip) and one
    ``add_`` applies it. No temporaries: every buffer is allocated once per call.

    The torch ops run on one thread (:func:`one_torch_thread`, as the server's folds do):
    they work on cache-sized blocks, so a second OpenMP thread adds a synchronisation per op
    (2,400 per 300-step update of 1M values) that stalls whenever another process holds the
    other core; on a loaded 2-core machine two threads took 10x the CPU-seconds of one.
    """
    if not steps or theta.numel() == 0:
        return
    keys = [prng.stream_keys(seed) for seed, _ in steps]
    size = theta.numel()
    draw = BlockDraw(min(block, size))
    table = torch.empty_like(prng._TABLE_CPU)
    with one_torch_thread(), torch.no_grad():
        for start in range(0, size, block):
            n = min(block, size - start)
            part, z = theta[start : start + n], draw.block(start, n)
            for (_, coeff), stream in zip(steps, keys, strict=True):
                torch.mul(prng._TABLE_CPU, coeff, out=table)  # +-coeff: exact
                part.add_(z(stream, table))


class BlockDraw:
    """The CPU kernel's generator: values ``start .. start+n-1`` of a stream, each bit of its
    words mapped through ``table`` (a row per byte: ``+-1``, or ``+-coeff`` for a scaled draw),
    into buffers allocated once for blocks of up to ``max_block`` values. :meth:`block` picks
    the range (its views are made once per block, not per stream); each call then draws one
    stream into the same view, overwriting the last. Call it under :func:`one_torch_thread`
    (see :func:`_apply_steps_cpu`)."""

    def __init__(self, max_block: int) -> None:
        max_words = (max_block + 31) // 32 + 1  # a block may straddle one extra word
        self._counter = np.arange(max_words, dtype=np.uint32)
        self._words = np.empty(max_words, dtype=np.uint32)
        self._scratch = np.empty(max_words, dtype=np.uint32)
        self._index = torch.empty(4 * max_words, dtype=torch.int32)
        self._values = torch.empty(32 * max_words, dtype=torch.float32)
        # little-endian: byte q of a word is its bits 8q..8q+7
        self._bytes = torch.from_numpy(self._words.view(np.uint8))
        self.block(0, max_block)

    def block(self, start: int, n: int) -> BlockDraw:
        """Draw values ``start .. start+n-1`` from now on."""
        self._first, last = start >> 5, (start + n - 1) >> 5
        count, skip = last - self._first + 1, start & 31
        self._block_words, self._block_bytes = self._words[:count], self._bytes[: 4 * count]
        self._block_index = self._index[: 4 * count]
        values = self._values[: 32 * count]
        self._rows, self._z = values.view(-1, 8), values[skip : skip + n]
        return self

    def __call__(self, stream: tuple[int, int], table: torch.Tensor) -> torch.Tensor:
        prng.hash_words_into(stream, self._first, self._block_words, self._scratch,
                             self._counter)
        self._block_index.copy_(self._block_bytes)
        torch.index_select(table, 0, self._block_index, out=self._rows)
        return self._z


@dataclass(frozen=True)
class ZOSteps:
    """A decoded step log: ``lr`` and, per step, the seed and the applied (dequantised) g."""

    lr: float
    seeds: npt.NDArray[np.uint64]
    grads: npt.NDArray[np.float32]
    #: The int8 step; 0.0 when the scalars travel as float16.
    gscale: float = 0.0
    coefficients: npt.NDArray[np.float32] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.seeds.shape != self.grads.shape or self.seeds.ndim != 1:
            raise ValueError("seeds and grads must be 1-D arrays of equal length")
        object.__setattr__(self, "coefficients", step_coefficient(self.lr, self.grads))

    def __len__(self) -> int:
        return int(self.seeds.size)


@overload
def replay(reference: torch.Tensor, steps: ZOSteps, *, block: int = ...) -> torch.Tensor: ...
@overload
def replay(reference: FlatVector, steps: ZOSteps, *, block: int = ...) -> FlatVector: ...
def replay(reference: torch.Tensor | FlatVector, steps: ZOSteps, *,
           block: int = APPLY_BLOCK) -> torch.Tensor | FlatVector:
    """The client's model, bit for bit: ``steps`` applied to a copy of ``reference``.

    A tensor stays on its device; a NumPy vector is replayed on CPU and returned as NumPy.
    """
    if isinstance(reference, torch.Tensor):
        theta = reference.detach().to(torch.float32).clone().contiguous()
        apply_steps(theta, steps.seeds, steps.coefficients, block=block)
        return theta
    theta_np = np.array(reference, dtype=np.float32, copy=True).reshape(-1)
    apply_steps(torch.from_numpy(theta_np), steps.seeds, steps.coefficients, block=block)
    return theta_np


def zo_gradient(loss: Callable[[torch.Tensor], float | torch.Tensor], theta: torch.Tensor, *,
                seed: int, eps: float) -> float:
    """MeZO's two-point estimate ``(L(theta + eps z) - L(theta - eps z)) / (2 eps)``.

    Unlike MeZO's in-place perturb-and-restore, theta is never modified: ``theta + eps z - eps z``
    is not ``theta`` in floating point, and that drift would break exact replay. The perturbed
    points are built in one scratch copy, the single model-sized temporary.
    """
    _check_theta(theta)
    step = _as_float32(np.float32(eps))
    if not step > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    scratch = theta.detach().clone()
    apply_step(scratch, seed, step)
    plus = float(loss(scratch))
    scratch.copy_(theta)
    apply_step(scratch, seed, -step)
    minus = float(loss(scratch))
    return (plus - minus) / (2.0 * step)


# -- the codec ----------------------------------------------------------------------------------


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
        _check_theta(theta)
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


# -- FedKSeed: a shared pool of K seeds ---------------------------------------------------------


class SeedPool:
    """FedKSeed's pool of K seeds shared by every client, https://arxiv.org/abs/2312.06353.

    Clients draw their step seeds from the pool, so the sum of all coefficients ever applied
    along pool seed ``j`` is one number per seed. The server keeps those sums (float64) and
    publishes them as a float32 vector ``C`` of length K; the global model is *defined* as
    ``pool_model(base, pool, C)``, the K canonical steps of :func:`apply_pool` applied to the
    agreed base model. A client that missed any number of rounds downloads ``C`` (4K bytes) and
    rebuilds exactly the server's model.

    Seeds are ``derive_seed(base_seed, j)`` narrowed to ``seed_bits``, for ``j = 0, 1, ...``,
    skipping repeats until K distinct seeds are found.
    """

    def __init__(self, k: int, base_seed: int, *, seed_bits: int = 32) -> None:
        if k < 1:
            raise ValueError(f"pool size must be positive, got {k}")
        if seed_bits not in (32, 64):
            raise ValueError(f"seed_bits must be 32 or 64, got {seed_bits}")
        mask, index = (1 << seed_bits) - 1, 0
        seeds: list[int] = []
        position: dict[int, int] = {}
        while len(seeds) < k:
            seed = prng.derive_seed(base_seed, index) & mask
            index += 1
            if seed not in position:
                position[seed] = len(seeds)
                seeds.append(seed)
        self.seeds: tuple[int, ...] = tuple(seeds)
        self.base_seed = base_seed
        self._position = position

    def __len__(self) -> int:
        return len(self.seeds)

    def index(self, seed: int) -> int:
        """Position of ``seed`` in the pool; ValueError when it is not a pool seed."""
        try:
            return self._position[int(seed)]
        except KeyError:
            raise ValueError(f"seed {seed} is not in the pool") from None

    def sample(self, rng: np.random.Generator) -> int:
        """A pool seed drawn uniformly, as FedKSeed's clients do each step."""
        return self.seeds[int(rng.integers(len(self.seeds)))]

    def contribution(self, steps: ZOSteps) -> npt.NDArray[np.float64]:
        """Per pool seed, the sum of the coefficients a decoded step log applied along it."""
        out = np.zeros(len(self.seeds), dtype=np.float64)
        try:
            where = np.fromiter((self._position[int(s)] for s in steps.seeds), dtype=np.int64,
                                count=len(steps))
        except KeyError as err:
            raise CodecError(f"codec 'seed': step seed {err.args[0]} is not in the pool") from None
        np.add.at(out, where, steps.coefficients.astype(np.float64))
        return out


@functools.lru_cache(maxsize=8)
def _cached_pool(k: int, base_seed: int, seed_bits: int) -> SeedPool:
    return SeedPool(k, base_seed, seed_bits=seed_bits)


def _check_cumulative(pool: SeedPool, cumulative: npt.ArrayLike) -> npt.NDArray[np.float32]:
    values = np.asarray(cumulative)
    if values.dtype != np.float32 or values.shape != (len(pool),):
        raise ValueError(f"cumulative must be float32 of shape ({len(pool)},), got "
                         f"{values.dtype} {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("cumulative holds NaN or Inf")
    return values


def apply_pool(theta: torch.Tensor, pool: SeedPool, cumulative: npt.ArrayLike, *,
               block: int = APPLY_BLOCK) -> None:
    """The canonical pool step: ``apply_step(theta, pool.seeds[j], cumulative[j])`` for j = 0..K-1.

    ``cumulative`` is the published float32 vector; zeros are skipped. Because the global model
    is defined by this function applied to the base model, catch-up is exact by construction.
    """
    apply_steps(theta, pool.seeds, _check_cumulative(pool, cumulative), block=block)


@overload
def pool_model(base: torch.Tensor, pool: SeedPool, cumulative: npt.ArrayLike) -> torch.Tensor: ...
@overload
def pool_model(base: FlatVector, pool: SeedPool, cumulative: npt.ArrayLike) -> FlatVector: ...
def pool_model(base: torch.Tensor | FlatVector, pool: SeedPool,
               cumulative: npt.ArrayLike) -> torch.Tensor | FlatVector:
    """The global model of a pool session: a copy of ``base`` with :func:`apply_pool` applied."""
    if isinstance(base, torch.Tensor):
        theta = base.detach().to(torch.float32).clone().contiguous()
        apply_pool(theta, pool, cumulative)
        return theta
    theta_np = np.array(base, dtype=np.float32, copy=True).reshape(-1)
    apply_pool(torch.from_numpy(theta_np), pool, cumulative)
    return theta_np
