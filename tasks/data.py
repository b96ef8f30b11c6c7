"""Datasets that ship offline: scikit-learn's bundled digits and seeded synthetic data."""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class ArrayDataset:
    """Features ``x`` (float32, one row per example) and integer labels ``y``."""

    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"{self.x.shape[0]} feature rows but {self.y.shape[0]} labels")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, index: npt.NDArray[np.int64]) -> ArrayDataset:
        return ArrayDataset(self.x[index], self.y[index])

    @property
    def num_classes(self) -> int:
        return int(self.y.max()) + 1 if len(self) else 0


def train_test_split(data: ArrayDataset, *, test_fraction: float, seed: int
                     ) -> tuple[ArrayDataset, ArrayDataset]:
    """A seeded, stratified split so every class is present in the test set."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    test_idx: list[npt.NDArray[np.int64]] = []
    for c in np.unique(data.y):
        members = np.flatnonzero(data.y == c)
        rng.shuffle(members)
        test_idx.append(members[: max(1, round(test_fraction * len(members)))])
    test = np.sort(np.concatenate(test_idx))
    train = np.setdiff1d(np.arange(len(data)), test)
    return data.subset(train), data.subset(test)


def load_digits(*, seed: int = 0, test_fraction: float = 0.2) -> tuple[ArrayDataset, ArrayDataset]:
    """The 1,797 8x8 digit images bundled with scikit-learn, scaled to [0, 1]."""
    data = _read_digits_csv(_bundled_digits_path())
    return train_test_split(data, test_fraction=test_fraction, seed=seed)


def _bundled_digits_path() -> Path:
    # Locate scikit-learn's data file without importing scikit-learn (over a second per
    # process, which adds up when a machine starts many clients).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the digits task needs scikit-learn installed (its bundled data)")
    return Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"


def _read_digits_csv(path: Path) -> ArrayDataset:
    """Rows of 64 pixel values (0..16) followed by the label."""
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    if table.ndim != 2 or table.shape[1] != 65:
        raise ValueError(f"{path}: expected 65 columns per row, got {table.shape}")
    return ArrayDataset(table[:, :64] / 16.0, table[:, 64].astype(np.int64))


def make_synthetic(*, num_examples: int, num_features: int = 64, num_classes: int = 10,
                   seed: int = 0, noise: float = 1.0) -> ArrayDataset:
    """Gaussian class clusters: a cheap learnable task of any size."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, size=(num_classes, num_features)).astype(np.float32)
    y = rng.integers(0, num_classes, size=num_examples).astype(np.int64)
    x = centres[y] + noise * rng.normal(0, 1, size=(num_examples, num_features)).astype(np.float32)
    return ArrayDataset(x.astype(np.float32), y)
