"""Column runners (aggregation/columns.py): a rule's per-coordinate work gives the same bits
however its column blocks are split, ordered and run."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from murmura.aggregation import RobustDefault
from murmura.aggregation.columns import (
    BLOCK,
    UNIT,
    ThreadColumns,
    blocks,
    reduction_unit,
    run_blocks,
)
from murmura.aggregation.robust_stats import (
    coordinate_median,
    huber_mean,
    pairwise_sq_distances,
    row_norms,
    trimmed_mean,
    weighted_sum,
)
from murmura.aggregation.sybil_scores import sign_bits, sketch_rows


class ShuffledRanges:
    """A runner that cuts the columns into random whole-unit ranges and runs them in a random
    order, as workers that answer in any order would; it counts what it ran and the arrays
    it handed out (all of them must come back)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.runs = 0
        self.live: dict[int, np.ndarray] = {}

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        array = np.full(shape, np.nan, dtype=dtype) if np.dtype(dtype).kind == "f" \
            else np.empty(shape, dtype=dtype)  # NaN: an unwritten row would show
        self.live[id(array)] = array
        return array

    def release(self, array: np.ndarray) -> None:
        self.live.pop(id(array), None)

    def run(self, kernel: Any, arrays: Mapping[str, np.ndarray | None], params: Any,
            out: np.ndarray | None, p: int, *, unit: int = BLOCK) -> None:
        self.runs += 1
        units = blocks(p, unit)
        cuts = sorted(self.rng.sample(range(1, len(units)), min(3, len(units) - 1))) \
            if len(units) > 1 else []
        edges = [0, *cuts, len(units)]
        ranges = [(units[i][0], units[j - 1][1]) for i, j in zip(edges, edges[1:], strict=False)]
        self.rng.shuffle(ranges)
        for a, b in ranges:
            run_blocks(kernel, arrays, params, out, a, b, unit)


def updates(version: int, n: int, p: int) -> list[np.ndarray]:
    rng = np.random.default_rng([version, 3])
    base = rng.standard_normal(p).astype(np.float32)
    return [((base + rng.standard_normal(p).astype(np.float32)) * 0.01 * (1 + 0.1 * i))
            .astype(np.float32) for i in range(n)]


def test_blocks_cut_whole_units_and_refuse_a_misaligned_start() -> None:
    assert blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert blocks(10, 4, start=4) == [(4, 8), (8, 10)]
    assert blocks(0, 4) == []
    with pytest.raises(ValueError, match="block boundary"):
        blocks(10, 4, start=3)
    assert reduction_unit(BLOCK) == UNIT
    assert reduction_unit(1000) % 1000 == 0 and UNIT <= reduction_unit(1000) < UNIT + 1000
    with pytest.raises(ValueError):
        reduction_unit(0)


@pytest.mark.parametrize("p", [1, BLOCK - 1, 3 * BLOCK + 17, UNIT + 5, 2 * UNIT + BLOCK])
def test_norms_sketches_and_per_coordinate_rules_are_the_same_bits_on_any_split(p: int) -> None:
    rng = np.random.default_rng(p)
    x = rng.standard_normal((7, p)).astype(np.float32)
    extra = rng.standard_normal((5, p)).astype(np.float32)
    one = ThreadColumns(max_threads=1)
    for runner in (ThreadColumns(), ShuffledRanges(p)):
        assert np.array_equal(row_norms(x, runner=runner), row_norms(x, runner=one))
        assert np.array_equal(sketch_rows(x, dim=64, seed=2, runner=runner),
                              sketch_rows(x, dim=64, seed=2, runner=one))
        kw = dict(c=1.0, weights=np.arange(1.0, 5.0), rows=np.array([0, 2, 3, 6]),
                  extra=extra, extra_rows=np.array([1, 4]), tail=min(p, 9), tail_c=2.0)
        assert np.array_equal(huber_mean(x, runner=runner, **kw), huber_mean(x, runner=one, **kw))
        rows = np.array([6, 1, 3, 4])
        assert np.array_equal(coordinate_median(x, rows=rows, runner=runner),
                              coordinate_median(x, rows=rows, runner=one))
        assert np.array_equal(trimmed_mean(x, trim_count=2, runner=runner),
                              trimmed_mean(x, trim_count=2, runner=one))
        assert np.array_equal(pairwise_sq_distances(x, runner=runner),
                              pairwise_sq_distances(x, runner=one))
        c = np.linspace(0.1, 1.0, 7)
        assert np.array_equal(weighted_sum(x, c, runner=runner), weighted_sum(x, c))


def test_norms_keep_the_float32_overflow_and_nan_of_a_row() -> None:
    x = np.ones((3, 2 * UNIT), dtype=np.float32)
    x[1, :] = 3e19  # each square overflows float32
    x[2, 5] = np.nan
    norms = row_norms(x)
    assert norms[0] == pytest.approx(np.sqrt(2 * UNIT))
    assert np.isinf(norms[1]) and np.isnan(norms[2])


def test_a_sketch_with_kept_sign_bits_equals_the_cached_one() -> None:
    x = np.random.default_rng(1).standard_normal((2, 70_001)).astype(np.float32)
    signs = sign_bits(70_001, 100, 9)
    assert signs.shape == ((70_001 + 7) // 8,)
    assert np.array_equal(sketch_rows(x, dim=100, seed=9, signs=signs),
                          sketch_rows(x, dim=100, seed=9))
    assert not np.allclose(sketch_rows(x, dim=100, seed=10), sketch_rows(x, dim=100, seed=9))


def test_default_gives_the_same_bits_whatever_runs_its_columns() -> None:
    """Versions with history rows: the runner holds the rows, the history, the sign bits and
    copies rows into the history; the model is the threads' bit for bit."""
    p = UNIT + 3 * BLOCK + 11
    plain, split = RobustDefault(p), RobustDefault(p)
    runner = ShuffledRanges(0)
    split.use_columns(runner)
    for version in range(4):
        for i, u in enumerate(updates(version, 9, p)):
            cid = f"c{(i + 5 * version) % 14}"
            plain.add(u, 10.0 + i, factor=0.9, client_id=cid)
            split.add(u, 10.0 + i, factor=0.9, client_id=cid)
        a, b = plain.result(), split.result()
        assert np.array_equal(a, b), f"version {version} differs"
        assert np.array_equal(plain.last_effective, split.last_effective)
        plain.reset()
        split.reset()
    assert len(split.last_history) > 0, "no history rows joined the statistic"
    assert runner.runs > 0
    # rows, history rows and sign bits live in the runner's arrays
    assert any(a is split._rows for a in runner.live.values())
    assert any(a is split._past for a in runner.live.values())


def test_moving_to_a_runner_keeps_what_the_rule_holds() -> None:
    p = 2 * BLOCK
    rule, moved = RobustDefault(p), RobustDefault(p)
    for version in range(2):
        for i, u in enumerate(updates(version, 6, p)):
            rule.add(u, 5.0, client_id=f"c{i}")
            moved.add(u, 5.0, client_id=f"c{i}")
        if version == 0:
            rule.result(), moved.result()
            rule.reset(), moved.reset()
    moved.use_columns(ShuffledRanges(1))  # mid-buffer, with history rows kept
    assert np.array_equal(rule.result(), moved.result())
