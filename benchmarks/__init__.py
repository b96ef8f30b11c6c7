"""Murmura benchmarks: run ``python benchmarks/<name>.py [--quick]``; not part of the package."""
