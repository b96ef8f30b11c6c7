"""What a device can do for this task: measured training speed, memory, mixed precision.

A client measures its speed at start with a short timed warm-up of the task's own model (a
copy, so the real model is untouched) and sends it with Join: ``DeviceProfile.steps_per_s``,
and in ``extra`` the examples/s, the batch size it was measured at, free memory and the
mixed-precision modes the device supports. A computing-power-aware server (FedCompass) plans
local work from it until it has observed the client's own tasks.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from murmura.edge.device import _system_memory, device_profile
from murmura.protocols import DeviceProfile

log = logging.getLogger(__name__)

AMP_MODES = ("auto", "off", "bf16", "fp16")


def amp_supported(device: torch.device) -> tuple[str, ...]:
    """Mixed-precision modes worth using on ``device``: CUDA has fp16 and (Ampere on) bf16.
    CPU autocast exists but rarely pays on small models, so it is only used when asked."""
    if device.type != "cuda":
        return ()
    modes = ["fp16"]
    if torch.cuda.is_bf16_supported():
        modes.insert(0, "bf16")
    return tuple(modes)


def amp_dtype(device: torch.device, mode: str = "auto") -> torch.dtype | None:
    """The autocast dtype for ``mode`` on ``device``, or None for full fp32.

    ``auto`` is bf16 (or fp16 where bf16 is missing) on CUDA and fp32 elsewhere; ``bf16`` and
    ``fp16`` are used as asked (on the CPU too); ``off`` is fp32.
    """
    if mode not in AMP_MODES:
        raise ValueError(f"amp must be one of {AMP_MODES}, got {mode!r}")
    if mode == "off":
        return None
    if mode == "auto":
        supported = amp_supported(device)
        if not supported:
            return None
        mode = supported[0]
    if device.type == "cuda" and mode == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("amp 'bf16' was asked for but this GPU does not support bfloat16")
    return torch.bfloat16 if mode == "bf16" else torch.float16


def amp_name(dtype: torch.dtype | None) -> str:
    return {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@dataclass(frozen=True)
class SpeedProfile:
    """A measured training speed."""

    steps_per_s: float
    examples_per_s: float
    batch_size: int
    amp: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_training_speed(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                           device: torch.device, batch_size: int = 16,
                           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                           = nn.functional.cross_entropy,
                           steps: int = 10, warmup: int = 3, amp: torch.dtype | None = None,
                           clock: Callable[[], float] = time.perf_counter) -> SpeedProfile:
    """Time ``steps`` SGD steps of a copy of ``model`` on one batch built from ``x, y``
    (repeated up to ``batch_size`` rows), after ``warmup`` untimed steps."""
    if steps < 1 or warmup < 0 or batch_size < 1 or len(x) == 0:
        raise ValueError("need steps >= 1, warmup >= 0, batch_size >= 1 and some data")
    reps = -(-batch_size // len(x))
    xb = x.repeat((reps,) + (1,) * (x.dim() - 1))[:batch_size].to(device)
    yb = y.repeat((reps,) + (1,) * (y.dim() - 1))[:batch_size].to(device)
    probe = copy.deepcopy(model).to(device)
    probe.train()
    opt = torch.optim.SGD(probe.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)

    def one() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = loss_fn(probe(xb), yb)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(warmup):
        one()
    _sync(device)
    t0 = clock()
    for _ in range(steps):
        one()
    _sync(device)
    elapsed = max(clock() - t0, 1e-9)
    return SpeedProfile(steps / elapsed, steps * batch_size / elapsed, batch_size,
                        amp_name(amp))


def probe_micro_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                      device: torch.device, largest: int = 1024,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                      = nn.functional.cross_entropy,
                      attempt: Callable[[int], None] | None = None) -> int:
    """The most rows (``largest``, halving) one forward and backward pass of ``model`` takes
    on ``device`` without running out of memory (under a ``set_per_process_memory_fraction``
    cap, that cap). The trainer then accumulates gradients over passes of that size, so the
    server's batch size is kept whatever the device. ``attempt(rows)`` replaces the real pass
    (tests).

    Raises ValueError when not even one row fits: such a device can only train zeroth-order.
    """
    if attempt is None:
        probe = copy.deepcopy(model).to(device)

        def attempt(rows: int) -> None:
            reps = -(-rows // len(x))
            xb = x.repeat((reps,) + (1,) * (x.dim() - 1))[:rows].to(device)
            yb = y.repeat((reps,) + (1,) * (y.dim() - 1))[:rows].to(device)
            probe.zero_grad(set_to_none=True)
            loss_fn(probe(xb), yb).backward()
            _sync(device)

    rows = largest
    while rows >= 1:
        try:
            attempt(rows)
            return rows
        except torch.OutOfMemoryError:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows //= 2
    raise ValueError(f"not even one example fits in the memory of {device}: train "
                     f"zeroth-order (trainer 'zo') on this device")


def free_memory(device: torch.device) -> int:
    """Bytes free for training on ``device`` now (0 when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _system_memory()


def profile_device(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                   device: torch.device, batch_size: int = 16, amp: str = "auto",
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   = nn.functional.cross_entropy, steps: int = 10) -> DeviceProfile:
    """The device profile sent with Join, with the measured speed of ``model``'s training.

    Extras (all short strings, within the server's limit of 16): ``examples_per_s``,
    ``profile_batch``, ``amp`` (the mode used), ``amp_supported``, ``memory_free``.
    """
    dtype = amp_dtype(device, amp)
    speed = measure_training_speed(model, x, y, device=device, batch_size=batch_size,
                                   loss_fn=loss_fn, steps=steps, amp=dtype)
    base = device_profile(device, steps_per_s=speed.steps_per_s)
    extra = dict(base.extra)
    extra.update({"examples_per_s": f"{speed.examples_per_s:.1f}",
                  "profile_batch": str(speed.batch_size), "amp": speed.amp,
                  "amp_supported": ",".join(amp_supported(device)) or "none",
                  "memory_free": str(free_memory(device))})
    log.info("device %s: %.1f examples/s (batch %d, amp %s)", device, speed.examples_per_s,
             speed.batch_size, speed.amp)
    return DeviceProfile(device=base.device, device_name=base.device_name,
                         memory_bytes=base.memory_bytes, steps_per_s=speed.steps_per_s,
                         cpu_count=base.cpu_count, extra=extra)


__all__ = ["AMP_MODES", "SpeedProfile", "amp_dtype", "amp_name", "amp_supported",
           "free_memory", "measure_training_speed", "probe_micro_batch", "profile_device"]
