"""Liveness of sync cohorts (no network, a hand-driven clock): a member silent for longer than
its measured task time allows, or whose waiting call was cancelled and that never came back,
leaves the cohort, so neither its round nor the next waits for it."""

from __future__ import annotations

import pytest

from murmura.server import ServerConfig, Unauthenticated
from murmura.server.core import LOST_GRACE_S
from murmura.server.policy import LIVENESS_MIN_S
from tests.server.test_core import Clock, joined, make_core, push

STEP = [0.5, 0.5, 0.5, 0.5]


def run_round(core, clock, sessions, task_s: float) -> None:
    """Every member takes its task now and pushes ``task_s`` later."""
    for s in sessions:
        core.task(s)
    clock.t += task_s
    for s in sessions:
        push(core, s, STEP)


def test_a_member_silent_past_its_bound_leaves_and_the_round_closes_without_it() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=2, liveness_factor=1.5, round_deadline_s=600)
    sessions = joined(core, "a", "b", "c")
    for _ in range(2):
        run_round(core, clock, sessions, task_s=4.0)
    assert core.version == 2
    assert core.policy.task_s["c"] == pytest.approx(4.0)
    assert core.policy.liveness_bound("c") == pytest.approx(6.0)
    # round 3: c takes its task and is never heard of again
    for s in sessions:
        core.task(s)
    clock.t += 4.0
    push(core, sessions[0], STEP)
    push(core, sessions[1], STEP)
    core.tick()
    assert core.version == 2  # 4 s of silence: within c's bound
    clock.t += 2.5            # 6.5 s since c was last seen: past 1.5 x 4 s
    core.tick()
    assert core.version == 3 and core.active_client_ids() == ["a", "b"]
    with pytest.raises(Unauthenticated, match="has ended"):
        core.task(sessions[2])
    # the next round's cohort is the survivors: it closes as soon as they have pushed
    run_round(core, clock, sessions[:2], task_s=4.0)
    assert core.version == 4


def test_a_member_that_keeps_calling_is_alive_however_long_it_takes() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=2, liveness_factor=1.5, round_deadline_s=600)
    a, b = joined(core, "a", "b")
    run_round(core, clock, [a, b], task_s=2.0)
    core.task(a), core.task(b)
    push(core, a, STEP)
    for _ in range(20):  # b pulls the model again and again (a slow link): 10 s, not silent
        clock.t += 0.5
        core.model(b)
        core.tick()
    assert core.active_client_ids() == ["a", "b"] and core.version == 1


def test_a_round_where_everyone_is_slower_drops_no_one() -> None:
    """Load on the clients' machines slows every member alike: the first push of the round
    sets the scale, and members as slow as it stay."""
    clock = Clock()
    core = make_core(clock, min_clients=3, liveness_factor=1.5, round_deadline_s=600)
    sessions = joined(core, "a", "b", "c")
    run_round(core, clock, sessions, task_s=2.0)
    for s in sessions:
        core.task(s)
    clock.t += 3.5       # everyone is slower: past 1.5 x 2 s, but nobody has pushed yet
    core.tick()
    assert core.active_client_ids() == ["a", "b", "c"]
    clock.t += 0.5
    push(core, sessions[0], STEP)  # a took 4 s, twice its usual: the bound doubles to 6 s
    core.tick()
    clock.t += 1.5
    core.tick()          # b and c: 5.5 s, within 1.5 x 2 s x 2
    assert core.active_client_ids() == ["a", "b", "c"]
    push(core, sessions[1], STEP)  # b took 5.5 s: the scale is the slowest pusher's, 2.75
    clock.t += 2.5       # c: 8 s, within 1.5 x 2 s x 2.75 = 8.25 s
    core.tick()
    assert core.active_client_ids() == ["a", "b", "c"]
    clock.t += 0.5       # c: 8.5 s, past it
    core.tick()
    assert core.active_client_ids() == ["a", "b"] and core.version == 2


def test_without_a_measurement_only_the_round_deadline_applies() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=2, liveness_factor=1.5, round_deadline_s=30)
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    assert core.policy.liveness_bound("b") is None
    clock.t += 29
    push(core, a, STEP)
    core.tick()
    assert core.version == 0 and core.active_client_ids() == ["a", "b"]
    clock.t += 1.5
    core.tick()
    assert core.version == 1  # the deadline closed the round with a's update


def test_a_new_member_is_judged_by_the_cohorts_median_and_never_below_the_floor() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=2, liveness_factor=2.0, round_deadline_s=600)
    a, b = joined(core, "a", "b")
    run_round(core, clock, [a, b], task_s=0.1)
    assert core.policy.liveness_bound("a") == LIVENESS_MIN_S  # 2 x 0.1 s is below the floor
    joined(core, "c")
    assert core.policy.liveness_bound("c") == LIVENESS_MIN_S
    run_round(core, clock, [a, b], task_s=3.0)   # a and b: 0.5 x (0.1 + 3.0) = 1.55 s
    assert core.policy.liveness_bound("c") == pytest.approx(2 * 1.55)


def test_liveness_factor_zero_turns_the_check_off() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=2, liveness_factor=0, round_deadline_s=600)
    a, b = joined(core, "a", "b")
    run_round(core, clock, [a, b], task_s=1.0)
    core.task(a), core.task(b)
    clock.t += 100
    core.tick()
    assert core.active_client_ids() == ["a", "b"]


def test_liveness_factor_is_validated() -> None:
    with pytest.raises(ValueError, match="liveness_factor must be 0 .off. or at least 1"):
        ServerConfig.from_flat(liveness_factor=0.5)


def test_a_lost_waiting_call_ends_the_session_unless_the_client_calls_again() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=2)
    a, b = joined(core, "a", "b")
    core.lost_contact(a)
    core.lost_contact(b)
    clock.t += LOST_GRACE_S / 2
    core.task(b)  # b's retry arrives within the grace: it stays
    clock.t += LOST_GRACE_S
    core.tick()
    assert core.active_client_ids() == ["b"]
    with pytest.raises(Unauthenticated):
        core.task(a)
