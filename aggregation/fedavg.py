"""Weighted federated averaging, streamed one update at a time.

FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", https://arxiv.org/abs/1602.05629.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from murmura.aggregation.base import (
    AggregationError,
    Aggregator,
    FlatVector,
    register_aggregator,
)
from murmura.aggregation.partial import ExactSum, Partial, exact_mean

#: None until the first read-only update; then whether torch.from_numpy warns every time.
_readonly_warns_every_time: bool | None = None


def _as_tensor(x: FlatVector) -> torch.Tensor:
    """``x`` as a tensor sharing its memory; read-only arrays too, without a warning.

    torch warns about read-only arrays (np.frombuffer on received bytes), which is harmless
    here because the update tensor is only read, but it does so once per process
    (TORCH_WARN_ONCE). So only the first read-only update needs ``warnings.catch_warnings``,
    which costs ~3 us (2% of folding a 4 MB update); a second conversion there tells whether
    this torch warns once, as assumed, or every time, which keeps the guard on every call.
    """
    global _readonly_warns_every_time
    if x.flags.writeable or _readonly_warns_every_time is False:
        return torch.from_numpy(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensor = torch.from_numpy(x)
        if _readonly_warns_every_time is None:
            torch.from_numpy(x)
    if _readonly_warns_every_time is None:
        repeated = sum("not writable" in str(w.message) for w in caught) > 1
        _readonly_warns_every_time = repeated
    return tensor


def _fused_add(acc: torch.Tensor, update: torch.Tensor, alpha: float) -> None:
    """acc += alpha * update in one pass (torch ``add_`` with ``alpha``).

    The sum is memory-bound, so it runs fastest on one thread (measured on a 2-core machine:
    5 GB/s with two threads against 17 GB/s with one, the numpy roofline). Torch's thread
    count is process-wide, so this pure rule leaves it alone: the server folds under
    ``murmura.protocols.codecs.one_torch_thread`` (its publisher thread), and other callers
    choose for themselves.
    """
    acc.add_(update, alpha=alpha)


#: Accumulator alignment: a cache line (and one AVX-512 vector).
ALIGN_BYTES = 64


def aligned_zeros(size: int, align: int = ALIGN_BYTES) -> FlatVector:
    """A zeroed float32 vector whose first element starts on an ``align``-byte boundary.

    Large numpy allocations come from ``mmap`` plus malloc's 16-byte header, so they start 16
    bytes past a page: every 64-byte vector store of the fold then straddles two cache lines.
    An aligned accumulator made torch's single-threaded ``add_`` 6-7% faster on 4 MB vectors
    (AMD EPYC, AVX-512), which is most of its gap to numpy's ``+=``. Costs ``align`` bytes.
    """
    raw = np.zeros(size * 4 + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + size * 4].view(np.float32)


class WeightedMean(Aggregator):
    """sum_i w_i f_i u_i / sum_i w_i, in one float32 accumulator (or, opt-in, an exact one).

    The accumulate step is one fused multiply-add over the vector (torch ``add_`` with
    ``alpha``, into a cache-line-aligned accumulator), which runs at memory bandwidth on one
    thread (the caller sets torch's threads: see :func:`_fused_add`); memory stays O(model)
    whatever the number of updates. Float32 summation depends on the order of the updates;
    callers that need bit-identical reruns add them in a fixed order (the sync policy does).

    ``exact=True`` accumulates in an :class:`ExactSum` instead (about 15-20x the cost of the
    float32 fold, 16 bytes per value): the result is then bit-identical whatever the order of
    the updates and however they were grouped into partials, so a hierarchy of leaves and
    parents, or any number of workers, publishes exactly the flat run's model.

    The rule is decomposable: :meth:`partial` hands out the state (weighted sum, total weight,
    count) and :meth:`merge` folds another aggregator's partial in, as if its updates had been
    added here.
    """

    name = "fedavg"
    decomposable = True

    def __init__(self, size: int, *, exact: bool = False) -> None:
        super().__init__(size)
        self._shape = (size,)
        self._exact = ExactSum(size) if exact else None
        self._acc = aligned_zeros(size if not exact else 1)
        self._acc_t = torch.from_numpy(self._acc)
        self._total = 0.0
        self._count = 0

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def add(self, update: FlatVector, weight: float, *, factor: float = 1.0,
            client_id: str = "") -> None:
        if self._exact is not None:
            self._exact.add(update, weight, factor=factor)
            return
        w, f = float(weight), float(factor)
        # The common case in plain floats (~0.2 us); anything odd gets the shared check, which
        # raises with its message (numpy scalar checks cost ~1 us, 0.6% of a 4 MB fold).
        if not (update.shape == self._shape and 0.0 < w < math.inf and 0.0 <= f < math.inf):
            self._check(update, weight, factor)
        if update.dtype != np.float32:
            update = update.astype(np.float32)
        _fused_add(self._acc_t, _as_tensor(update), w * f)
        self._total += w
        self._count += 1

    def partial(self) -> Partial:
        """The current state as a :class:`Partial` (a copy: later adds leave it alone)."""
        if self._exact is not None:
            return Partial(self._exact.copy(), self._exact.total_weight, self._exact.count)
        return Partial(self._acc.copy(), self._total, self._count)

    def merge(self, partial: Partial, *, factor: float = 1.0) -> None:
        """Fold in another aggregator's partial as if its updates had been added here.

        ``factor`` scales the partial's sum (a stale partial is discounted as a whole); its
        weight adds to the normaliser and its count to :attr:`count`. An exact partial may
        enter a float32 aggregator (rounded to float32 once); a float32 partial cannot enter
        an exact one, whose result would then depend on the order the leaf added in.
        """
        if not isinstance(partial, Partial):
            raise AggregationError(f"can only merge a Partial, got {type(partial).__name__}")
        if partial.size != self.size:
            raise AggregationError(f"partial has {partial.size} values, expected {self.size}")
        f = float(factor)
        if not (math.isfinite(f) and f >= 0):
            raise AggregationError(f"factor must be non-negative and finite, got {factor}")
        if partial.count == 0:
            raise AggregationError("the partial is empty (count 0): nothing to merge")
        if self._exact is not None:
            if not isinstance(partial.sum, ExactSum):
                raise AggregationError(
                    "a float32 partial cannot enter an exact aggregator: its sum already "
                    "depends on the order its leaf added in; build the leaf with exact=True")
            self._exact.merge(partial.sum if f == 1.0 else partial.sum.scaled(f))
            return
        if isinstance(partial.sum, ExactSum):
            vector = partial.sum.value().astype(np.float32)
        else:
            vector = partial.sum
        _fused_add(self._acc_t, _as_tensor(vector), f)
        self._total += float(partial.weight)
        self._count += partial.count

    def result(self) -> FlatVector:
        if self._exact is not None:
            if self._exact.count == 0:
                raise AggregationError("no updates to aggregate")
            return exact_mean(self._exact)
        if self._count == 0:
            raise AggregationError("no updates to aggregate")
        return (self._acc / np.float32(self._total)).astype(np.float32, copy=False)

    def reset(self) -> None:
        if self._exact is not None:
            self._exact.reset()
            return
        self._acc.fill(0.0)
        self._total = 0.0
        self._count = 0

    @property
    def count(self) -> int:
        return self._exact.count if self._exact is not None else self._count

    @property
    def total_weight(self) -> float:
        return float(self._exact.total_weight) if self._exact is not None else self._total


def weighted_mean(updates: list[FlatVector], weights: list[float]) -> FlatVector:
    """Convenience: the weighted mean of a list of updates (same result as streaming)."""
    if not updates:
        raise AggregationError("no updates to aggregate")
    agg = WeightedMean(updates[0].shape[0])
    for u, w in zip(updates, weights, strict=True):
        agg.add(u, w)
    return agg.result()


register_aggregator("fedavg", WeightedMean)
