"""The weighted-mean fold's performance details: an aligned accumulator, no per-update warning
machinery, a plain-float argument check that refuses what the shared check refuses."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from murmura.aggregation import AggregationError, WeightedMean
from murmura.aggregation.fedavg import ALIGN_BYTES, aligned_zeros


@pytest.mark.parametrize("size", [1, 7, 1000, 1_000_003])
def test_aligned_zeros_is_an_aligned_zeroed_float32_vector(size: int) -> None:
    v = aligned_zeros(size)
    assert v.shape == (size,) and v.dtype == np.float32 and v.flags.c_contiguous
    assert v.flags.writeable and v.ctypes.data % ALIGN_BYTES == 0 and not v.any()
    v[:] = 1.0  # the whole view is usable memory
    assert v.sum() == size


def test_the_accumulator_stays_aligned_and_one_vector(rng) -> None:
    agg = WeightedMean(1001)
    assert agg._acc.ctypes.data % ALIGN_BYTES == 0 and agg._acc.nbytes == 4004
    agg.add(rng.normal(size=1001).astype(np.float32), 2.0)
    agg.reset()
    assert agg._acc.ctypes.data % ALIGN_BYTES == 0 and not agg._acc.any()


def test_the_fold_matches_a_float64_reference_with_unaligned_read_only_inputs(rng) -> None:
    n, size = 12, 4099
    raw = [rng.normal(size=size + 1).astype("<f4").tobytes() for _ in range(n)]
    ups = [np.frombuffer(r, dtype="<f4", count=size, offset=4) for r in raw]  # 4-byte offset
    ws = [float(w) for w in rng.uniform(1, 50, size=n)]
    fs = [float(f) for f in rng.uniform(0, 1, size=n)]
    agg = WeightedMean(size)
    for u, w, f in zip(ups, ws, fs, strict=True):
        agg.add(u, w, factor=f)
    expected = sum(w * f * u.astype(np.float64) for u, w, f in zip(ups, ws, fs, strict=True))
    np.testing.assert_allclose(agg.result(), expected / sum(ws), rtol=1e-5, atol=1e-5)
    assert agg.total_weight == pytest.approx(sum(ws)) and agg.count == n


def test_read_only_updates_fold_without_any_warning() -> None:
    payload = np.arange(8, dtype="<f4").tobytes()
    agg = WeightedMean(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            agg.add(np.frombuffer(payload, dtype="<f4"), 1.0)
    np.testing.assert_array_equal(agg.result(), np.arange(8, dtype=np.float32))


def test_other_dtypes_are_folded_as_float32() -> None:
    agg = WeightedMean(3)
    agg.add(np.array([1, 2, 3], dtype=np.float64), 1.0)
    agg.add(np.array([3, 2, 1], dtype=">f4"), 1.0)
    np.testing.assert_array_equal(agg.result(), np.full(3, 2.0, np.float32))


@pytest.mark.parametrize("weight, factor", [
    (0.0, 1.0), (-1.0, 1.0), (math.inf, 1.0), (math.nan, 1.0),
    (1.0, -0.5), (1.0, math.inf), (1.0, math.nan),
    (np.float32(0.0), 1.0), (np.float64(math.nan), 1.0),
])
def test_bad_weights_and_factors_are_refused_and_change_nothing(weight, factor) -> None:
    agg = WeightedMean(4)
    with pytest.raises(AggregationError):
        agg.add(np.ones(4, np.float32), weight, factor=factor)
    assert agg.count == 0 and agg.total_weight == 0.0 and not agg._acc.any()


def test_numpy_scalar_weights_and_a_zero_factor_are_taken() -> None:
    agg = WeightedMean(2)
    agg.add(np.ones(2, np.float32), np.int64(3), factor=np.float32(0.0))
    agg.add(np.full(2, 4.0, np.float32), np.float32(1.0))
    np.testing.assert_array_equal(agg.result(), np.full(2, 1.0, np.float32))
    with pytest.raises(AggregationError, match="shape"):
        agg.add(np.ones((2, 1), np.float32), 1.0)


def test_a_torch_that_warns_on_every_read_only_array_stays_silenced(monkeypatch) -> None:
    from murmura.aggregation import fedavg

    real = fedavg.torch.from_numpy

    def noisy(x: np.ndarray):  # noqa: ANN202 - stands in for torch.from_numpy
        if not x.flags.writeable:
            warnings.warn("The given NumPy array is not writable", UserWarning, stacklevel=2)
        return real(x) if x.flags.writeable else real(x.copy())

    monkeypatch.setattr(fedavg.torch, "from_numpy", noisy)
    monkeypatch.setattr(fedavg, "_readonly_warns_every_time", None)
    payload = np.full(4, 2.0, "<f4").tobytes()
    agg = WeightedMean(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            agg.add(np.frombuffer(payload, dtype="<f4"), 1.0)
    assert fedavg._readonly_warns_every_time is True
    np.testing.assert_array_equal(agg.result(), np.full(4, 2.0, np.float32))
