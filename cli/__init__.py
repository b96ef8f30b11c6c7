"""Murmura: federated and decentralized learning on heterogeneous devices.

The root package holds only the version and the CLI; importing it loads nothing heavy.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
