"""Write ``digits.npz``, the digits data the ``digits`` task ships, from scikit-learn's copy.

The data is the test set of the UCI "Optical Recognition of Handwritten Digits" data set
(E. Alpaydin and C. Kaynak, 1998, https://doi.org/10.24432/C50P49, CC BY 4.0) as scikit-learn
bundles it (``sklearn.datasets.load_digits``): 1,797 images of 8x8 pixels, each pixel a count
of 0..16, and their labels 0..9. ``tasks/DIGITS.md`` carries the attribution that ships with the
file. The package reads the file with numpy alone, so running a job needs no scikit-learn.

Run once, with scikit-learn installed (the ``dev`` extra), to rebuild the file::

    python -m murmura.tasks._make_digits

A test rebuilds the arrays from scikit-learn and compares them with the committed file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

#: The committed data file, next to this module (package data of ``murmura.tasks``).
DIGITS_NPZ = Path(__file__).resolve().parent / "digits.npz"


def digits_arrays() -> dict[str, npt.NDArray[np.uint8]]:
    """scikit-learn's digits as ``pixels`` (1797 x 64, uint8, 0..16) and ``target`` (uint8)."""
    from sklearn.datasets import load_digits  # dev-only dependency

    bunch = load_digits()
    data, target = np.asarray(bunch.data), np.asarray(bunch.target)
    pixels = data.astype(np.uint8)
    labels = target.astype(np.uint8)
    # The cast must lose nothing: whole counts 0..16 and labels 0..9, as the UCI files hold.
    if not (np.array_equal(pixels, data) and pixels.max() <= 16):
        raise ValueError("scikit-learn's digits pixels are no longer whole counts 0..16")
    if not (np.array_equal(labels, target) and labels.max() <= 9):
        raise ValueError("scikit-learn's digits labels are no longer 0..9")
    return {"pixels": pixels, "target": labels}


def write(path: Path = DIGITS_NPZ) -> Path:
    """Write the arrays to ``path`` as a compressed ``.npz``; return the path."""
    arrays = digits_arrays()
    np.savez_compressed(path, pixels=arrays["pixels"], target=arrays["target"])
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = write(Path(args[0]) if args else DIGITS_NPZ)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
