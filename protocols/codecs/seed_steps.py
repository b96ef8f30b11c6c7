"""Seeded +-1 steps applied exactly: the arithmetic a zeroth-order client and the server share.

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

This module holds that arithmetic and its kernels (CPU, any torch device, and the fused CUDA
kernel of :mod:`murmura.protocols.codecs.seed_triton`), the decoded step log
(:class:`ZOSteps`) with its :func:`replay`, and MeZO's two-point estimate of ``g``. The wire
format is :mod:`murmura.protocols.codecs.seed`; FedKSeed's shared seed pool is
:mod:`murmura.protocols.codecs.seed_pool`.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols import prng
from murmura.protocols.codecs._util import one_torch_thread
from murmura.protocols.codecs.base import FlatVector

__all__ = [
    "APPLY_BLOCK",
    "BlockDraw",
    "ZOSteps",
    "apply_step",
    "apply_steps",
    "check_theta",
    "replay",
    "step_coefficient",
    "zo_gradient",
]

log = logging.getLogger(__name__)

#: Values per block when walking a model: big enough to amortise kernel launches, small enough
#: that a block of the model and of z stay in a CPU's L2 cache while every step is applied.
APPLY_BLOCK = 1 << 18


def step_coefficient(lr: float, g: float | npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``float32(-(float32(lr) * float32(g)))``: the exact number a step adds times ``z``.

    Computed once, the same way, on both sides; a NumPy float32 multiply is one IEEE rounding.
    An overflow gives Inf silently; :func:`apply_steps` and the decoder refuse it.
    """
    with np.errstate(over="ignore"):
        product = np.multiply(np.float32(lr), np.asarray(g, dtype=np.float32), dtype=np.float32)
    return np.negative(product, dtype=np.float32)


def check_theta(theta: torch.Tensor) -> None:
    """Refuse all but a contiguous 1-D float32 tensor: every kernel writes theta in place."""
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
    check_theta(theta)
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
    check_theta(theta)
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
