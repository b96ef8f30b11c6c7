"""GetTask long polls on a live loopback server wake when the answer they wait for can change,
not at every accepted update: a sync round of n clients would otherwise re-ask the core for
every waiting poll at every push (O(n^2) task calls per round on the event loop)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from murmura.client import GrpcTransport
from murmura.protocols import Action, DeviceProfile
from murmura.server.service import HELD_POLL_RECHECK_S

from .test_grpc import ONES, header, small_core
from .test_tier import wait_until

pytestmark = pytest.mark.integration

N = 8        # the cohort
WAITING = 4  # clients that pushed early and wait for the next round


def _first_pushes(serve: Any, core: Any, pushed: int) -> tuple[GrpcTransport, list[str]]:
    """Serve ``core``; N clients join and are told to train; the first ``pushed`` push."""
    srv = serve(core)
    t = GrpcTransport(srv.address, timeout_s=10)
    sessions = [t.join(f"c{i}", DeviceProfile())[0].session for i in range(N)]
    for s in sessions:
        assert t.task(s, 0).action == Action.TRAIN
    for s in sessions[:pushed]:
        t.push(header(s, ONES), ONES)
    return t, sessions


def _counting(core: Any) -> list[int]:
    """Count the core's task calls (each held poll's asks)."""
    calls = [0]
    task = core.task

    def counted(session: str) -> Any:
        calls[0] += 1
        return task(session)

    core.task = counted
    return calls


def test_waiting_polls_are_not_woken_by_pushes_that_change_nothing_they_wait_for(serve) -> None:
    # Prepare: a sync round of N clients; count the core's task calls
    core = small_core(min_clients=N, cohort_size=N, max_versions=2, round_deadline_s=1e9)
    calls = _counting(core)
    t, sessions = _first_pushes(serve, core, WAITING)
    got: dict[int, Any] = {}

    def poll(i: int) -> None:
        got[i] = t.task(sessions[i], 10.0)

    before = calls[0]
    threads = [threading.Thread(target=poll, args=(i,)) for i in range(WAITING)]
    for th in threads:
        th.start()
    wait_until(lambda: calls[0] >= before + WAITING)  # every poll asked once, and waits
    asked = calls[0]
    # Execute: three more pushes; the round stays open (one client is still missing)
    start = time.monotonic()
    for s in sessions[WAITING:N - 1]:
        t.push(header(s, ONES), ONES)
    time.sleep(0.05)
    woken = calls[0] - asked
    elapsed = time.monotonic() - start
    # Assert: no poll re-asked for those pushes (a poll also re-asks every
    # HELD_POLL_RECHECK_S, as a safety net: allow that); then the last push ends the round and
    # every poll gets its next task at once
    ticks = WAITING * (int(elapsed / HELD_POLL_RECHECK_S) + 1)
    assert woken <= ticks < WAITING * (N - 1 - WAITING), (woken, ticks)
    t.push(header(sessions[N - 1], ONES), ONES)
    for th in threads:
        th.join(timeout=5)
    assert all(got[i].action == Action.TRAIN and got[i].round == 2 for i in range(WAITING))
    t.close()


def test_held_polls_stay_quiet_while_nothing_they_wait_for_changes(serve) -> None:
    # Prepare: WAITING clients pushed their update of round 1 and hold a poll for round 2;
    # the others train on (no liveness bound: they are not taken for gone meanwhile)
    core = small_core(min_clients=N, cohort_size=N, max_versions=2, round_deadline_s=1e9,
                      liveness_factor=0)
    calls = _counting(core)
    t, sessions = _first_pushes(serve, core, WAITING)
    got: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, t.task(sessions[i], 20.0)))
               for i in range(WAITING)]
    before = calls[0]
    for th in threads:
        th.start()
    wait_until(lambda: calls[0] >= before + WAITING)
    asked = calls[0]
    # Execute: nothing happens for 1.5 s (the old safety net re-asked every 0.5 s)
    time.sleep(1.5)
    # Assert: no poll asked again; the round's end still answers every one of them
    assert calls[0] == asked
    for s in sessions[WAITING:]:
        t.push(header(s, ONES), ONES)
    for th in threads:
        th.join(timeout=5)
    assert all(got[i].action == Action.TRAIN and got[i].round == 2 for i in range(WAITING))
    t.close()


def test_a_round_deadline_wakes_held_polls_without_the_safety_recheck(serve) -> None:
    # Prepare: a round of N whose last member never pushes; it closes at its 1 s deadline
    core = small_core(min_clients=N, cohort_size=N, max_versions=3, round_deadline_s=1.0)
    t, sessions = _first_pushes(serve, core, N - 1)
    # Execute: a pushed client holds a poll across the deadline
    start = time.monotonic()
    answer = t.task(sessions[0], 20.0)
    elapsed = time.monotonic() - start
    # Assert: the deadline's tick published round 1 and woke the poll with round 2, well
    # before the safety recheck would have
    assert answer.action == Action.TRAIN and answer.round == 2
    assert core.version == 1
    assert elapsed < HELD_POLL_RECHECK_S - 1.0, elapsed
    t.close()
