"""Hostile input against the core: overflow bounds, expiring sessions, rate limits, counted
refusals. Each refusal leaves the global model and the other clients untouched."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.protocols import DeviceProfile
from murmura.server import InvalidArgument, ResourceExhausted, Unauthenticated
from murmura.server.core import FOLD_LIMIT

from .test_core import Clock, make_core, push


def joined(core, *ids):
    return [core.join(i, DeviceProfile()).session for i in ids]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("accumulator", ["float32", "exact"])
def test_values_that_could_overflow_the_fold_are_refused(mode: str, accumulator: str) -> None:
    """The fuzzer's finding: one coordinate of 1.7e38 with num_examples 10 made the model
    infinite for good. Now the update is refused and the round completes without it."""
    core = make_core(mode=mode, accumulator=accumulator, min_clients=2, buffer_size=2)
    a, b, c = joined(core, "a", "b", "c")
    before = core.params.copy()
    for s in (a, b, c):
        core.task(s)
    huge = 1.7e38 if accumulator == "float32" else 1e12
    with pytest.raises(InvalidArgument, match="too large to aggregate"):
        push(core, a, [huge, 0, 0, 0], n=10)
    assert np.array_equal(core.params, before) and core.traffic.updates == 0
    # two pushes of 3e38 (each finite, their sum not) fail the same way: the bound is on the sum
    if accumulator == "float32":
        push(core, b, [1e37, 0, 0, 0], n=5)  # 5e37: within the version's range
        with pytest.raises(InvalidArgument, match="already taken"):
            push(core, c, [1e37, 0, 0, 0], n=6)
    else:
        push(core, b, [1.0, 1.0, 1.0, 1.0], n=5)
    push(core, c, [1.0, 1.0, 1.0, 1.0], n=5)  # c retries with a sane update: taken
    if mode == "sync":  # a stays silent in this round: the deadline closes it
        core.clock.t += 1e6
        core.tick()
    assert core.version == 1
    assert np.isfinite(core.params).all()


def test_the_bound_resets_with_each_version() -> None:
    core = make_core(mode="async", min_clients=1, buffer_size=1)
    (a,) = joined(core, "a")
    big = FOLD_LIMIT["float32"] / 10 / 2  # half the range per version with n=10
    for _ in range(3):  # three versions, each well inside its own range
        push(core, a, [big, 0, 0, 0], n=10, base=core.version)
    assert core.version == 3 and core.fold_mass == 0.0


def test_a_new_global_model_that_is_not_finite_is_dropped() -> None:
    """Each update is inside the bound, but the server optimizer's step overflows float32:
    the version is dropped and the model stays as it was."""
    core = make_core(mode="async", min_clients=1, buffer_size=1, server_lr=1e38)
    (a,) = joined(core, "a")
    before = core.params.copy()
    push(core, a, [10.0, 0, 0, 0], n=1)
    assert core.version == 0 and np.array_equal(core.params, before)
    push(core, a, [1e-40, 0, 0, 0], n=1)  # a harmless update still makes a version
    assert core.version == 1


def test_sessions_expire_after_their_ttl_and_the_client_can_join_again() -> None:
    clock = Clock()
    core = make_core(clock=clock, mode="async", min_clients=1, session_ttl_s=60)
    a, b = joined(core, "a", "b")
    clock.t = 40
    core.task(b)              # b is seen at 40 s, a is not
    clock.t = 70
    core.tick()
    with pytest.raises(Unauthenticated, match="expired"):
        core.task(a)
    assert core.task(b).action.name == "TRAIN"
    assert core.status()["clients"] == 1
    (a2,) = joined(core, "a")
    assert core.task(a2).action.name == "TRAIN"


def test_an_expired_sync_cohort_member_no_longer_holds_the_round() -> None:
    clock = Clock()
    core = make_core(clock=clock, min_clients=2, session_ttl_s=60, round_deadline_s=1e9)
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    push(core, a, [1, 1, 1, 1])
    clock.t = 61
    core.task(a)  # a keeps its session alive; b went silent
    core.tick()
    assert core.version == 1  # the round closed without b instead of waiting forever


def test_joins_and_pushes_are_rate_limited_per_identity() -> None:
    clock = Clock()
    core = make_core(clock=clock, mode="async", min_clients=1, buffer_size=100,
                     join_per_s=1.0, push_per_s=2.0)
    for _ in range(10):               # the burst
        core.join("flood", DeviceProfile())
    with pytest.raises(ResourceExhausted) as err:
        core.join("flood", DeviceProfile())
    assert err.value.retry_after_s == pytest.approx(1.0)
    (ok,) = joined(core, "honest")   # another identity is not affected
    session = core.join("pusher", DeviceProfile()).session
    for _ in range(50):
        push(core, session, [0, 0, 0, 0])
    with pytest.raises(ResourceExhausted, match="pushes too often"):
        push(core, session, [0, 0, 0, 0])
    push(core, ok, [0, 0, 0, 0])
    clock.t += 1.0                    # two tokens back
    push(core, session, [0, 0, 0, 0])
    assert core.traffic.refused == {"RESOURCE_EXHAUSTED": 2}


def test_a_full_server_refuses_new_sessions_but_keeps_its_clients() -> None:
    core = make_core(mode="async", min_clients=1, max_sessions=2)
    a, _ = joined(core, "a", "b")
    with pytest.raises(ResourceExhausted, match="maximum of 2 sessions"):
        core.join("c", DeviceProfile())
    assert core.task(a).action.name == "TRAIN"
    core.join("a", DeviceProfile())  # a restarted client replaces its own session


def test_refusals_of_every_request_are_counted_by_status_in_the_metrics_row() -> None:
    core = make_core(mode="async", min_clients=1, buffer_size=1)
    with pytest.raises(InvalidArgument):
        core.join("", DeviceProfile())
    with pytest.raises(Unauthenticated):
        core.task("nope")
    with pytest.raises(Unauthenticated):
        core.model("nope")
    with pytest.raises(Unauthenticated):
        core.leave("nope")
    (a,) = joined(core, "a")
    with pytest.raises(InvalidArgument):
        push(core, a, [np.nan, 0, 0, 0])
    push(core, a, [1, 1, 1, 1])
    assert core.traffic.refused == {"INVALID_ARGUMENT": 2, "UNAUTHENTICATED": 3}
    assert core.last_metrics["refused"] == {"INVALID_ARGUMENT": 2, "UNAUTHENTICATED": 3}


def test_a_session_string_of_absurd_size_is_refused_without_a_lookup() -> None:
    core = make_core()
    with pytest.raises(InvalidArgument, match="sessions have at most"):
        core.task("s" * 100_000)
