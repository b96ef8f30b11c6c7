"""The bundled digits file: what it holds, that it loads without scikit-learn, and that it
equals scikit-learn's copy byte for byte where scikit-learn is installed."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the tomli backport, a dependency below 3.11
    import tomli as tomllib

from murmura.tasks import load_digits
from murmura.tasks.data import DIGITS_FILE, bundled_digits


def test_bundled_digits_are_1797_images_of_64_pixels_in_0_1_with_ten_classes() -> None:
    # Execute
    data = bundled_digits()

    # Assert
    assert data.x.shape == (1797, 64) and data.x.dtype == np.float32
    assert data.y.shape == (1797,) and data.y.dtype == np.int64
    assert data.x.min() == 0.0 and data.x.max() == 1.0
    assert np.array_equal(data.x * 16, np.round(data.x * 16))  # counts 0..16 over 16
    assert np.array_equal(np.unique(data.y), np.arange(10))


def test_the_data_file_and_its_attribution_ship_as_package_data() -> None:
    # Execute
    package = resources.files("murmura.tasks")

    # Assert: both are found where an installed package keeps its data
    assert (package / DIGITS_FILE).is_file()
    assert "CC BY 4.0" in (package / "DIGITS.md").read_text(encoding="utf-8")
    # and a wheel carries them: the package data lists both
    with (Path(__file__).resolve().parents[2] / "pyproject.toml").open("rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert {DIGITS_FILE, "DIGITS.md"} <= set(package_data["murmura.tasks"])


def test_loading_the_digits_imports_no_scikit_learn() -> None:
    # Prepare: a fresh interpreter, so nothing imported by other tests counts
    code = ("import sys\n"
            "from murmura.tasks import load_digits\n"
            "train, test = load_digits(seed=0)\n"
            "print(len(train), len(test), 'sklearn' in sys.modules)\n")

    # Execute
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()

    # Assert
    assert out == ["1438", "359", "False"]


def test_the_bundled_arrays_equal_scikit_learns_digits() -> None:
    sklearn_datasets = pytest.importorskip(
        "sklearn.datasets", reason="scikit-learn (dev extra) is the digits' reference copy")
    # Prepare
    reference = sklearn_datasets.load_digits()

    # Execute
    with resources.as_file(resources.files("murmura.tasks") / DIGITS_FILE) as path, \
            np.load(path) as archive:
        pixels, target = archive["pixels"], archive["target"]

    # Assert: the same values, and the float data the task trains on is bit for bit what
    # scaling scikit-learn's copy gives
    assert pixels.dtype == np.uint8 and target.dtype == np.uint8
    assert np.array_equal(pixels, reference.data) and np.array_equal(target, reference.target)
    expected = (reference.data.astype(np.float32) / np.float32(16.0)).tobytes()
    assert bundled_digits().x.tobytes() == expected


def test_the_generator_rebuilds_the_committed_arrays(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the generator reads scikit-learn's copy (dev extra)")
    from murmura.tasks import _make_digits

    # Execute
    written = _make_digits.write(tmp_path / "digits.npz")

    # Assert
    with np.load(written) as fresh, np.load(_make_digits.DIGITS_NPZ) as committed:
        assert sorted(fresh.files) == sorted(committed.files) == ["pixels", "target"]
        for name in fresh.files:
            assert fresh[name].dtype == committed[name].dtype
            assert fresh[name].tobytes() == committed[name].tobytes()


def test_the_split_is_seeded_and_stratified() -> None:
    # Execute
    train, test = load_digits(seed=3)
    again, _ = load_digits(seed=3)

    # Assert
    assert len(train) + len(test) == 1797
    assert np.array_equal(train.x, again.x) and np.array_equal(train.y, again.y)
    assert np.array_equal(np.unique(test.y), np.arange(10))
