"""``check_range``: the bound every decoded update and partial aggregate gets, and the
refusal of NaN and Inf, on the one-pass torch path and on NumPy's fallback alike."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.server.decoding import check_range
from murmura.server.errors import ServiceError


def _variants(values: np.ndarray) -> list[np.ndarray]:
    """The same values as a writable float32 vector (torch path), read-only and strided
    (NumPy path) and float64 (NumPy path)."""
    read_only = values.copy()
    read_only.flags.writeable = False
    strided = np.repeat(values, 2)[::2]
    return [values.copy(), read_only, strided, values.astype(np.float64)]


#: Small vectors take NumPy's path; from 2**20 values a writable float32 one takes torch's.
SIZES = [1000, (1 << 20) + 7]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("index", [0, 5, 999])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_with_the_first_bad_index(index: int, bad: float,
                                                                 size: int) -> None:
    values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    values[index] = bad
    for variant in _variants(values):
        with pytest.raises(ServiceError, match=f"first at index {index}"):
            check_range(variant, "update")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bound_is_the_largest_magnitude_on_either_side(sign: float, size: int) -> None:
    values = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    values[17] = sign * 40.0
    for variant in _variants(values):
        assert check_range(variant, "update") == 40.0


def test_empty_vector_has_bound_zero() -> None:
    assert check_range(np.empty(0, dtype=np.float32), "update") == 0.0
