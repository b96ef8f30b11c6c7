"""The publisher runs folds and publishing in submission order, off the caller's thread."""

from __future__ import annotations

import threading

import pytest

from murmura.server.publisher import Publisher


def test_threaded_jobs_run_in_submission_order_on_one_other_thread() -> None:
    pub = Publisher(threaded=True)
    seen: list[tuple[int, str]] = []
    try:
        futures = [pub.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
                   for i in range(200)]
        for f in futures:
            f.result(timeout=10)
    finally:
        pub.close()
    assert [i for i, _ in seen] == list(range(200))
    names = {name for _, name in seen}
    assert names == {"murmura-publisher"} and threading.current_thread().name not in names


def test_inline_publisher_runs_at_once_on_the_caller() -> None:
    pub = Publisher(threaded=False)
    where: list[str] = []
    fut = pub.submit(lambda: where.append(threading.current_thread().name) or 7)
    assert fut.done() and fut.result() == 7
    assert where == [threading.current_thread().name]


def test_a_failing_job_reports_through_its_future_and_later_jobs_still_run() -> None:
    pub = Publisher(threaded=True)
    try:
        bad = pub.submit(lambda: 1 / 0)
        good = pub.submit(lambda: "after")
        with pytest.raises(ZeroDivisionError):
            bad.result(timeout=10)
        assert good.result(timeout=10) == "after"
    finally:
        pub.close()


def test_submit_returns_while_a_long_job_runs_and_drain_waits_for_it() -> None:
    pub = Publisher(threaded=True)
    gate = threading.Event()
    try:
        fut = pub.submit(gate.wait)
        assert not fut.done() and pub.pending == 1  # the caller was not blocked
        gate.set()
        pub.drain(timeout=10)
        assert fut.done() and pub.pending == 0
    finally:
        pub.close()


def test_close_finishes_queued_jobs_then_refuses_new_ones() -> None:
    pub = Publisher(threaded=True)
    done: list[int] = []
    for i in range(5):
        pub.submit(lambda i=i: done.append(i))
    pub.close()
    assert done == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="closed"):
        pub.submit(lambda: None)


@pytest.mark.parametrize("threaded", [True, False])
def test_post_runs_in_order_and_logs_a_failure_without_stopping_later_jobs(threaded, caplog
                                                                            ) -> None:
    pub = Publisher(threaded=threaded)
    seen: list[int] = []
    try:
        with caplog.at_level("ERROR", logger="murmura.server.publisher"):
            pub.post(lambda: seen.append(1), what="job one")
            pub.post(lambda: 1 / 0, what="the broken job")
            pub.post(lambda: seen.append(3), what="job three")
            pub.drain(timeout=10)
    finally:
        pub.close()
    assert seen == [1, 3]
    failures = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(failures) == 1 and "the broken job failed" in failures[0].getMessage()
    assert failures[0].exc_info is not None and failures[0].exc_info[0] is ZeroDivisionError
