"""one_torch_thread: torch's process-wide thread count lowered and always restored."""

from __future__ import annotations

import threading

import numpy as np
import torch

from murmura.aggregation import WeightedMean
from murmura.protocols.codecs import one_torch_thread


def test_nested_blocks_restore_the_count_once_the_last_one_ends() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with one_torch_thread():
            assert torch.get_num_threads() == 1
            with one_torch_thread():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1  # the outer block is still running
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_overlapping_blocks_on_two_threads_leave_the_count_as_it_was() -> None:
    # A save/restore per caller would end at 1 here: the second thread enters after the first
    # lowered the count, saves 1, and restores it after the first has left.
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with one_torch_thread():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with one_torch_thread():
            second_in.set()
            first_out.wait(5)
            assert torch.get_num_threads() == 1

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert first_out.is_set() and second_in.is_set()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_an_exception_inside_the_block_still_restores_the_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        try:
            with one_torch_thread():
                raise RuntimeError("boom")
        except RuntimeError:
            pass
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_fedavg_rule_leaves_torch_s_thread_count_alone(monkeypatch) -> None:
    # A pure rule must not touch process-wide state: the server picks the threads for its folds.
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    agg = WeightedMean(200_000)
    agg.add(np.ones(200_000, np.float32), 2.0)
    agg.merge(agg.partial())
    assert agg.count == 2 and calls == []
