"""The seed codec's step kernel on CUDA: one pass over theta for any number of steps.

``apply_steps(theta, seeds, coeffs)`` adds ``coeff_t * z(seed_t)`` for t = 0, 1, ... to every
coordinate. The portable torch path draws ``z`` block by block with int64 tensor ops (dozens of
small kernels per block and step): on a GPU that is launch-bound, ~150x slower than memory
allows. This kernel does the whole log in one launch: each program loads a tile of theta into
registers, and for each step hashes the tile's counter words (:mod:`murmura.protocols.prng`'s
two-round lowbias32, in wrapping uint32 arithmetic), expands each word's 32 bits to ``+-coeff``
and adds them, then stores the tile once. Replaying k steps reads and writes theta once.

Why it is bit-identical to the CPU replay: the words are the same integers (the hash uses only
xor, logical shifts and wrapping 32-bit multiplies), and each step adds ``+coeff`` or
``-coeff`` (an exact sign flip) to each coordinate in step order, one correctly rounded float32
addition each, as the reference does. The test suite compares it with the CPU kernel on every
size class and offset pattern, through Triton's interpreter on a CPU and on a GPU when there
is one.

Triton is optional: :func:`available` says whether this kernel can run here.
"""

from __future__ import annotations

import os

import torch

__all__ = ["WORDS_PER_TILE", "apply_steps_cuda", "available"]

#: Counter words per program: a tile of 32x this many float32 values (8 KiB), 16 values per
#: thread of 4 warps, held in registers for the whole step log.
WORDS_PER_TILE = 64
#: lowbias32's multipliers as the int32 of their bit patterns (bitcast to uint32 in the kernel).
_C1 = 0x7FEB352D
_C2_AS_I32 = 0x846CA68B - (1 << 32)


try:  # optional: without triton, available() is False and the torch path runs
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means: not here
    triton = None


if triton is not None:
    _C1_K = tl.constexpr(_C1)  # kernels read globals only as constexpr
    _C2_K = tl.constexpr(_C2_AS_I32)

    @triton.jit
    def _mix(x):  # noqa: ANN001, ANN202 - lowbias32 on uint32 (wrapping)
        c1 = tl.full((), _C1_K, tl.int32).to(tl.uint32, bitcast=True)
        c2 = tl.full((), _C2_K, tl.int32).to(tl.uint32, bitcast=True)
        x = x ^ (x >> 16)
        x = x * c1
        x = x ^ (x >> 15)
        x = x * c2
        return x ^ (x >> 16)

    @triton.jit
    def _steps_kernel(theta_ptr, keys_ptr, coeff_ptr, n_steps, size,  # noqa: ANN001, ANN202
                      WORDS: tl.constexpr):
        pid = tl.program_id(0)
        words = pid.to(tl.int64) * WORDS + tl.arange(0, WORDS).to(tl.int64)
        bits = tl.arange(0, 32)
        offs = words[:, None] * 32 + bits[None, :]
        mask = offs < size
        x = tl.load(theta_ptr + offs, mask=mask, other=0.0)
        counter = words.to(tl.uint32)
        shifts = bits.to(tl.uint32)
        for t in range(n_steps):
            k0 = tl.load(keys_ptr + 2 * t).to(tl.uint32, bitcast=True)
            k1 = tl.load(keys_ptr + 2 * t + 1).to(tl.uint32, bitcast=True)
            c = tl.load(coeff_ptr + t)
            w = _mix(_mix(counter ^ k0) ^ k1)
            bit = (w[:, None] >> shifts[None, :]) & 1
            x = x + tl.where(bit == 0, c, -c)
        tl.store(theta_ptr + offs, x, mask=mask)


def available(device: torch.device) -> bool:
    """Whether the fused kernel runs on ``device`` (CUDA with triton, or triton's interpreter
    on any device when ``TRITON_INTERPRET=1``, which the tests use on CPUs)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def apply_steps_cuda(theta: torch.Tensor, keys: list[tuple[int, int]],
                     coeffs: list[float]) -> None:
    """``theta += sum_t coeffs[t] * z(keys[t])`` in step order, in place, in one launch.

    ``keys`` are the streams' (k0, k1) (:func:`murmura.protocols.prng.stream_keys`); zero
    coefficients must already be left out (the reference skips them, keeping -0.0 signs).
    ``theta`` is a contiguous float32 vector whose value 0 is stream value 0.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if not keys or theta.numel() == 0:
        return
    flat = [k - (1 << 32) if k >= 1 << 31 else k for pair in keys for k in pair]
    key_t = torch.tensor(flat, dtype=torch.int32, device=theta.device)
    coeff_t = torch.tensor(coeffs, dtype=torch.float32, device=theta.device)
    size = theta.numel()
    grid = (triton.cdiv(triton.cdiv(size, 32), WORDS_PER_TILE),)
    _steps_kernel[grid](theta, key_t, coeff_t, len(coeffs), size, WORDS=WORDS_PER_TILE,
                        num_warps=4)
