"""Device discovery and profiling, and launching client processes on a device."""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
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

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "DEVICES": "murmura.edge.device",
    "device_profile": "murmura.edge.device",
    "resolve_device": "murmura.edge.device",
    "AMP_MODES": "murmura.edge.profile",
    "SpeedProfile": "murmura.edge.profile",
    "amp_dtype": "murmura.edge.profile",
    "amp_supported": "murmura.edge.profile",
    "free_memory": "murmura.edge.profile",
    "measure_training_speed": "murmura.edge.profile",
    "probe_micro_batch": "murmura.edge.profile",
    "profile_device": "murmura.edge.profile",
}

__all__ = ["AMP_MODES", "DEVICES", "SpeedProfile", "amp_dtype", "amp_supported",
           "device_profile", "free_memory", "measure_training_speed", "probe_micro_batch",
           "profile_device", "resolve_device"]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
