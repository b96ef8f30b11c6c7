"""Device discovery and profiling, and launching client processes on a device."""

from murmura.edge.device import DEVICES, device_profile, resolve_device
from murmura.edge.profile import (
    AMP_MODES,
    SpeedProfile,
    amp_dtype,
    amp_supported,
    free_memory,
    measure_training_speed,
    probe_micro_batch,
    profile_device,
)

__all__ = ["AMP_MODES", "DEVICES", "SpeedProfile", "amp_dtype", "amp_supported",
           "device_profile", "free_memory", "measure_training_speed", "probe_micro_batch",
           "profile_device", "resolve_device"]
