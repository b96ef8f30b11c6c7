"""Datasets that ship offline: the bundled digits (``digits.npz``) and seeded synthetic data."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import numpy.typing as npt

#: The bundled digits, package data of ``murmura.tasks`` (written by ``_make_digits.py``).
DIGITS_FILE = "digits.npz"


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
    """The 1,797 8x8 digit images that ship with the package, scaled to [0, 1].

    They are scikit-learn's copy of the UCI handwritten digits (``tasks/DIGITS.md`` says where
    they come from and their licence), stored as ``digits.npz`` and read with numpy: loading
    them imports no scikit-learn.
    """
    return train_test_split(bundled_digits(), test_fraction=test_fraction, seed=seed)


def bundled_digits() -> ArrayDataset:
    """All 1,797 bundled digits: 64 pixel values in [0, 1] (counts 0..16 over 16) per row."""
    with resources.as_file(resources.files("murmura.tasks") / DIGITS_FILE) as path, \
            np.load(path) as archive:
        pixels, target = archive["pixels"], archive["target"]
    if pixels.shape != (1797, 64) or target.shape != (1797,):
        raise ValueError(f"{DIGITS_FILE}: expected 1797 x 64 pixels and 1797 labels, got "
                         f"{pixels.shape} and {target.shape}")
    return ArrayDataset(pixels.astype(np.float32) / np.float32(16.0), target.astype(np.int64))


def make_synthetic(*, num_examples: int, num_features: int = 64, num_classes: int = 10,
                   seed: int = 0, noise: float = 1.0, label_noise: float = 0.1) -> ArrayDataset:
    """Overlapping Gaussian classes that a model has to learn, of any size.

    Separable data would let a model reach its final accuracy in one step, so a run's curve
    would show nothing. Here the within-class noise is anisotropic: its standard deviation
    falls geometrically from 2 to 0.1 along the principal directions of a random rotation (so
    every feature mixes them), and the class means lie closest, relative to that noise, where
    it is largest. A linear model's first steps follow the raw mean differences, dominated by
    the noisy directions, so it starts near chance and climbs only as it learns to weight the
    quiet ones, which SGD does slowly on such an ill-conditioned problem. Each class has its
    own covariance (a random shear and scale), so the best boundary is quadratic, and a
    ``label_noise`` fraction of labels is redrawn uniformly: with the defaults a trained
    logistic regression plateaus near 0.9. Seeded.
    """
    if num_examples < 0 or num_features < 1 or num_classes < 2:
        raise ValueError("make_synthetic needs num_examples >= 0, num_features >= 1 and "
                         f"num_classes >= 2, got {num_examples}, {num_features}, {num_classes}")
    if not 0 <= label_noise < 1:
        raise ValueError(f"label_noise must lie in [0, 1), got {label_noise}")
    rng = np.random.default_rng(seed)
    d = num_features
    rotation, _ = np.linalg.qr(rng.standard_normal((d, d)))
    spread = np.geomspace(2.0, 0.1, d)  # noise std along each rotated direction
    # Mean differences scale with spread**0.25 while the noise scales with spread: the quiet
    # directions carry most of the signal, the loud ones most of the first gradient.
    means = ((0.3 * rng.standard_normal((num_classes, d)) * spread ** 0.25) @ rotation.T
             ).astype(np.float32)
    shear = (np.eye(d) + 0.5 / np.sqrt(d) * rng.standard_normal((num_classes, d, d)))
    scale = rng.uniform(0.7, 1.3, size=num_classes)
    # Per class: unit noise -> class shear and scale -> spread along the rotated directions.
    maps = (scale[:, None, None] * shear * spread[None, None, :] @ rotation.T[None]
            ).astype(np.float32)
    y = rng.integers(0, num_classes, size=num_examples).astype(np.int64)
    z = rng.standard_normal((num_examples, d), dtype=np.float32)
    x = np.empty((num_examples, d), dtype=np.float32)
    for c in range(num_classes):
        rows = np.flatnonzero(y == c)
        x[rows] = means[c] + noise * (z[rows] @ maps[c])
    flip = rng.random(num_examples) < label_noise
    y[flip] = rng.integers(0, num_classes, size=int(flip.sum()))
    return ArrayDataset(x, y)
