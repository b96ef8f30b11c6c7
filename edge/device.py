"""Which device a client trains on, and what it says about it when it joins."""

from __future__ import annotations

import os
import platform

import torch

from murmura.protocols import DeviceProfile

DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA, then MPS, then CPU; an explicit device must be available."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for but CUDA is not available")
        return torch.device(name)
    if name == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError("device 'mps' was asked for but MPS is not available")
        return torch.device("mps")
    if name == "cpu":
        return torch.device("cpu")
    if name != "auto":
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_profile(device: torch.device, *, steps_per_s: float = 0.0) -> DeviceProfile:
    """Describe ``device``: its kind, name and usable memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, int(props.total_memory)
    elif device.type == "mps":
        name, memory = "Apple MPS", _system_memory()
    else:
        name, memory = platform.machine() or "cpu", _system_memory()
    return DeviceProfile(device=device.type, device_name=name, memory_bytes=memory,
                         steps_per_s=steps_per_s, cpu_count=os.cpu_count() or 1,
                         extra={"torch": torch.__version__, "python": platform.python_version()})


def _system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
