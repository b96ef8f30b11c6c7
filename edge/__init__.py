"""Device discovery and profiling, and launching client processes on a device."""

from murmura.edge.device import DEVICES, device_profile, resolve_device

__all__ = ["DEVICES", "device_profile", "resolve_device"]
