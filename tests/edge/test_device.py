"""Device selection and profiles."""

from __future__ import annotations

import pytest
import torch

from murmura.edge import device_profile, resolve_device


def test_cpu_is_always_available_and_profiled() -> None:
    dev = resolve_device("cpu")
    prof = device_profile(dev)
    assert prof.device == "cpu" and prof.cpu_count >= 1 and prof.memory_bytes > 0
    assert prof.extra["torch"] == torch.__version__


def test_auto_picks_an_available_device() -> None:
    dev = resolve_device("auto")
    expected = "cuda" if torch.cuda.is_available() else dev.type
    assert dev.type == expected


def test_unavailable_or_unknown_devices_are_refused() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
