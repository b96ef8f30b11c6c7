"""Map the top-level folders onto one importable package, ``murmura``.

Metadata lives in pyproject.toml; this file only computes the package list so a nested
sub-package can never be left out of the wheel (see shared/style.md, Part 3).
"""

from setuptools import find_packages, setup

ROOT, ROOT_DIR = "murmura", "cli"
LAYERS = ("aggregation", "client", "edge", "gossip", "protocols", "server", "simulation",
          "tasks")

package_dir = {ROOT: ROOT_DIR}
packages = [ROOT]
for layer in LAYERS:
    package_dir[f"{ROOT}.{layer}"] = layer
    packages += [f"{ROOT}.{layer}"] + [f"{ROOT}.{layer}.{sub}" for sub in find_packages(layer)]

setup(package_dir=package_dir, packages=packages)
