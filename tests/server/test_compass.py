"""FedCompass: the pure scheduling decisions (property tests) and the policy on the core."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.protocols import Action, DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.compass import (
    GroupPlan,
    StepBounds,
    choose_group,
    founder_steps,
    plan_batch,
    refine_step_time,
    steps_for,
    version_step,
)

# -- pure functions ---------------------------------------------------------------------------

bounds_st = st.integers(1, 50).flatmap(
    lambda q_min: st.builds(StepBounds, st.just(q_min), st.integers(q_min, 200),
                            st.floats(1.0, 3.0)))
step_times_st = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4),
                                st.floats(1e-3, 100.0), min_size=1, max_size=30)
groups_st = st.lists(st.tuples(st.floats(0.1, 1e4), st.floats(1.0, 2.0)), max_size=5)


def _existing(raw: list[tuple[float, float]], now: float) -> list[GroupPlan]:
    return [GroupPlan(i + 1, now + d, now + d * f) for i, (d, f) in enumerate(raw)]


@settings(max_examples=100, deadline=None)
@given(step_times_st, bounds_st, groups_st, st.floats(0, 1e4))
def test_plan_batch_steps_within_bounds_and_groups_arrive_together(times, bounds, raw, now):
    groups = _existing(raw, now)
    assignments, created = plan_batch(times, now, groups, bounds, next_gid=100)

    assert set(assignments) == set(times)
    assert [g.gid for g in created] == list(range(100, 100 + len(created)))
    arrival = {g.gid: g.arrival for g in [*groups, *created]}
    for cid, a in assignments.items():
        assert bounds.q_min <= a.steps <= bounds.q_max
        # predicted finish: never after the group's arrival, at most one step before it
        finish = now + a.steps * times[cid]
        assert finish <= arrival[a.gid] * (1 + 1e-9) + 1e-9
        assert arrival[a.gid] - finish < times[cid] * (1 + 1e-6) + 1e-9
    for g in created:  # a new group is expected when its founder's steps are done
        founders = [c for c, a in assignments.items()
                    if a.gid == g.gid and math.isclose(now + a.steps * times[c], g.arrival,
                                                       rel_tol=1e-9, abs_tol=1e-9)]
        assert founders and g.latest >= g.arrival > now


@settings(max_examples=100, deadline=None)
@given(step_times_st, bounds_st, groups_st, st.floats(0, 1e4))
def test_plan_batch_faster_clients_never_get_fewer_steps_in_a_group(times, bounds, raw, now):
    assignments, _ = plan_batch(times, now, _existing(raw, now), bounds, next_gid=100)

    by_group: dict[int, list[tuple[float, int]]] = {}
    for cid, a in assignments.items():
        by_group.setdefault(a.gid, []).append((times[cid], a.steps))
    for members in by_group.values():
        for t1, q1 in members:
            for t2, q2 in members:
                if t1 < t2:
                    assert q1 >= q2


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-3, 10), bounds_st, groups_st, st.floats(0, 1e3))
def test_choose_group_gives_the_most_steps_that_fit(t, bounds, raw, now):
    groups = _existing(raw, now)
    a = choose_group(groups, now, t, bounds)

    fits = [q for g in groups if (q := steps_for(g.arrival, now, t, bounds)) is not None]
    if not fits:
        assert a is None
    else:
        assert a is not None and a.steps == max(fits)


anchors_st = st.lists(st.tuples(st.floats(-10.0, 1e3), st.floats(1e-3, 10.0)), max_size=5)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-3, 10.0), bounds_st, anchors_st, st.floats(0, 100.0))
def test_founder_steps_align_with_an_open_groups_next_arrival(t, bounds, anchors, now):
    """Algorithm 2 of the paper: a founder ends by (and within one of its steps of) the next
    arrival of an open group's fastest member, or gets q_max when no such arrival is reachable
    within q_max steps."""
    q = founder_steps(now, t, bounds, anchors)

    assert bounds.q_min <= q <= bounds.q_max
    nexts = [latest + fastest * bounds.q_max for latest, fastest in anchors if latest > now]
    reachable = [n for n in nexts if (n - now) / t < bounds.q_max + 1 - 1e-6]
    if not reachable:
        assert q == bounds.q_max or any(abs((n - now) / t - (bounds.q_max + 1)) < 1e-6
                                        for n in nexts)
    elif q > bounds.q_min:
        finish = now + q * t
        assert any(finish <= n * (1 + 1e-9) + 1e-9 and n - finish < t * (1 + 1e-6)
                   for n in nexts)
        # and it is the latest such arrival: no reachable one leaves room for more steps
        assert all(math.floor((n - now) / t + 1e-9) <= q for n in reachable)


def test_founder_steps_examples() -> None:
    b = StepBounds(2, 10)
    assert founder_steps(0.0, 1.0, b) == 10                   # no group: the most steps
    # a group due at latest 1.5 whose fastest member does 0.1 s/step: back at 2.5
    assert founder_steps(0.0, 1.0, b, [(1.5, 0.1)]) == 2      # 2 x 1.0 s ends at 2.0
    assert founder_steps(0.0, 0.2, b, [(1.5, 0.1)]) == 10     # 12 steps to 2.5: too many
    assert founder_steps(0.0, 2.0, b, [(1.5, 0.1)]) == 2      # 1 step fits: raised to q_min
    assert founder_steps(2.0, 1.0, b, [(1.5, 0.1)]) == 10     # that group is past its latest
    assert founder_steps(0.0, 1.0, b, [(1.5, 0.1), (4.0, 0.2)]) == 6   # the later one: 6.0


def test_steps_for_refuses_past_groups_and_out_of_bounds_work() -> None:
    b = StepBounds(2, 10)
    assert steps_for(5.0, 5.0, 0.1, b) is None          # the group is due now
    assert steps_for(5.0, 4.0, 1.0, b) is None          # one step only: below q_min
    assert steps_for(100.0, 0.0, 1.0, b) is None        # 100 steps: above q_max
    assert steps_for(10.0, 0.0, 1.0, b) == 10
    assert steps_for(10.0, 0.0, math.inf, b) is None


@settings(max_examples=100, deadline=None)
@given(step_times_st, bounds_st, groups_st, st.floats(0, 1e4), st.integers(1, 6),
       st.lists(st.integers(0, 8), max_size=5))
def test_plan_batch_never_fills_a_group_past_max_group(times, bounds, raw, now, cap, held):
    capped = StepBounds(bounds.q_min, bounds.q_max, bounds.latest_factor, cap)
    groups = _existing(raw, now)
    sizes = {g.gid: n for g, n in zip(groups, held, strict=False)}
    assignments, created = plan_batch(times, now, groups, capped, next_gid=100, sizes=sizes)

    members = dict(sizes)
    for a in assignments.values():
        members[a.gid] = members.get(a.gid, 0) + 1
    for gid, n in members.items():
        joined = n - sizes.get(gid, 0)
        # nobody joins a group already at the cap; the rest fill each group up to it
        assert joined == 0 or n <= cap, (gid, n, sizes.get(gid, 0))
    assert set(assignments) == set(times)


def test_step_bounds_and_refinement_validate() -> None:
    with pytest.raises(ValueError, match="max_group"):
        StepBounds(1, 4, 1.5, -1)
    with pytest.raises(ValueError, match="q_min <= q_max"):
        StepBounds(5, 4)
    with pytest.raises(ValueError, match="latest_factor"):
        StepBounds(1, 4, 0.5)
    assert refine_step_time(None, 10.0, 5) == 2.0
    assert refine_step_time(2.0, 40.0, 10) == 3.0
    assert refine_step_time(2.0, -1.0, 10) == 2.0 and refine_step_time(2.0, 1.0, 0) == 2.0


def test_compass_config_needs_step_bounds() -> None:
    with pytest.raises(ValueError, match="compass_max_steps"):
        ServerConfig.from_flat(mode="compass")
    with pytest.raises(ValueError, match="compass_min_steps 5 and compass_max_steps 4"):
        ServerConfig.from_flat(mode="compass", compass_max_steps=4, compass_min_steps=5)
    with pytest.raises(ValueError, match="for mode 'compass'"):
        ServerConfig.from_flat(mode="async", compass_max_steps=4)
    with pytest.raises(ValueError, match="compass_step_updates"):
        ServerConfig.from_flat(mode="compass", compass_max_steps=4, compass_step_updates=-1)
    assert ServerConfig.from_flat(mode="compass", compass_max_steps=20).compass_bounds() == \
        StepBounds(4, 20, 1.5)


# -- the policy on the core -------------------------------------------------------------------

SPEC = ModelSpec((TensorSpec("w", (4,)),))
P0 = np.zeros(4, np.float32)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _core(clock: Clock, **cfg) -> AggregatorCore:
    cfg.setdefault("compass_max_steps", 10)
    cfg.setdefault("require_identity", False)  # plain ids; tests/security covers identities
    return AggregatorCore(ServerConfig.from_flat(mode="compass", **cfg), SPEC, P0, clock=clock)


def _join(core: AggregatorCore, cid: str, steps_per_s: float = 0.0) -> str:
    return core.join(cid, DeviceProfile(steps_per_s=steps_per_s)).session


def _push(core: AggregatorCore, session: str, value: float, *, base: int, uid: str):
    payload = np.full(4, value, "<f4").tobytes()
    return core.push(UpdateHeader(session=session, update_id=uid, base_version=base,
                                  num_examples=10, codec="dense-f32",
                                  payload_bytes=len(payload),
                                  spec_fingerprint=core.fingerprint), payload)


def test_group_gets_steps_by_speed_and_becomes_one_version_when_all_arrive() -> None:
    clock = Clock()
    core = _core(clock)
    fast, slow = _join(core, "fast", 10.0), _join(core, "slow", 4.0)  # 0.1 and 0.25 s/step

    t_fast, t_slow = core.task(fast), core.task(slow)
    assert t_fast.action == t_slow.action == Action.TRAIN
    assert t_fast.local_steps == 10                          # founds a group due at t=1.0
    assert t_slow.local_steps == 4 and t_slow.round == t_fast.round  # 4 x 0.25 s: also at 1.0

    clock.t = 0.9
    _push(core, fast, 1.0, base=0, uid="f1")
    assert core.version == 0 and core.task(fast).action == Action.WAIT  # waits for its group
    clock.t = 1.1
    _push(core, slow, 3.0, base=0, uid="s1")
    assert core.version == 1
    np.testing.assert_allclose(core.params, np.full(4, 2.0))  # equal examples: the mean
    # both go on; speeds now come from what was observed (0.09 and 0.275 s/step)
    t_fast, t_slow = core.task(fast), core.task(slow)
    assert t_fast.action == t_slow.action == Action.TRAIN
    assert t_fast.local_steps >= t_slow.local_steps and t_fast.version == 1


def test_group_closes_at_its_latest_time_and_a_late_update_enters_the_next() -> None:
    clock = Clock()
    core = _core(clock, compass_latest_factor=1.5)
    a, b = _join(core, "a", 10.0), _join(core, "b", 10.0)
    assert core.task(a).local_steps == core.task(b).local_steps == 10   # one group, due 1.0
    clock.t = 1.0
    _push(core, a, 1.0, base=0, uid="a1")
    clock.t = 1.49
    core.tick()
    assert core.version == 0
    clock.t = 1.5                                   # latest = 1.0 + 0.5 x 1.0
    core.tick()
    assert core.version == 1
    np.testing.assert_allclose(core.params, np.full(4, 1.0))
    # b is late: its update waits for the next aggregate, with a staleness weight
    t = core.task(a)
    assert t.action == Action.TRAIN
    clock.t = 2.0
    _push(core, b, 4.0, base=0, uid="b1")
    assert core.version == 1 and core.policy.buffered() == 1
    clock.t = 2.5
    _push(core, a, 0.0, base=1, uid="a2")          # a's new group is complete
    assert core.version == 2
    w = 1 / math.sqrt(2)                            # polynomial staleness, tau = 1
    np.testing.assert_allclose(core.params, np.full(4, 1.0 + 4.0 * w / 2), rtol=1e-6)


def test_a_member_that_leaves_does_not_hold_its_group() -> None:
    clock = Clock()
    core = _core(clock)
    a, b = _join(core, "a", 10.0), _join(core, "b", 10.0)
    core.task(a), core.task(b)
    clock.t = 1.0
    _push(core, a, 2.0, base=0, uid="a1")
    core.leave(b)
    assert core.version == 1
    np.testing.assert_allclose(core.params, np.full(4, 2.0))


def test_unknown_speed_gets_the_most_steps_and_its_update_is_not_held() -> None:
    clock = Clock()
    core = _core(clock)
    s = _join(core, "new")
    task = core.task(s)
    assert task.action == Action.TRAIN and task.local_steps == 10
    clock.t = 3.0
    _push(core, s, 1.0, base=0, uid="n1")
    assert core.version == 1                       # no group to wait for: published alone
    nxt = core.task(s)                             # now measured: 0.3 s/step, its own group
    assert nxt.local_steps == 10 and core.policy.groups[nxt.round].plan.arrival == \
        pytest.approx(3.0 + 10 * 0.3)


def test_absurd_claimed_speeds_get_bounded_tasks_and_change_nothing_else() -> None:
    clock = Clock()
    core = _core(clock)
    honest = _join(core, "honest", 10.0)
    first = core.task(honest)
    liars = [_join(core, "fast-liar", 1e300), _join(core, "slow-liar", 1e-300)]
    tasks = [core.task(s) for s in liars]
    assert all(t.action == Action.TRAIN and 2 <= t.local_steps <= 10 for t in tasks)
    again = _join(core, "late", 10.0)
    assert core.task(again).round == first.round     # the honest group is still joinable
    assert math.isfinite(core.policy.deadline) and core.version == 0


def test_no_version_is_published_past_the_last() -> None:
    clock = Clock()
    core = _core(clock, max_versions=1)
    a, b, c = (_join(core, n, 10.0) for n in "abc")
    for s in (a, b):
        core.task(s)
    clock.t = 0.5
    core.task(c)                                   # joins the same group (5 steps)
    clock.t = 1.0
    _push(core, a, 1.0, base=0, uid="a1")
    _push(core, b, 1.0, base=0, uid="b1")
    core.leave(c)                                  # completes the group: version 1, the last
    assert core.version == 1 and core.done
    clock.t = 100.0
    core.tick()
    assert core.version == 1 and core.task(a).action == Action.STOP


def test_a_client_too_slow_for_the_open_group_founds_one_aligned_with_its_next_arrival() -> None:
    """Algorithm 2: the slow founder's group is due when the fast group's members come back
    from their next task, not q_max of its own slow steps later."""
    clock = Clock()
    core = _core(clock)
    fast, slow = _join(core, "fast", 10.0), _join(core, "slow", 1.0)   # 0.1 and 1.0 s/step
    t_fast, t_slow = core.task(fast), core.task(slow)
    assert t_fast.local_steps == 10                      # due 1.0, latest 1.5
    # 1 step of 1 s would end at 1.0: below q_min = 2, so it founds a group, aligned with the
    # fast member's next arrival (1.5 + 10 x 0.1 = 2.5): 2 steps, due at 2.0
    assert t_slow.round != t_fast.round and t_slow.local_steps == 2
    assert core.policy.groups[t_slow.round].plan.arrival == pytest.approx(2.0)


@pytest.mark.parametrize(("rule", "step_updates", "expected"), [
    ("sqrt", 0, 1.0),               # N = buffer_size 10 > 2 updates: the mean
    ("sqrt", 1, math.sqrt(2.0)),    # sqrt(2 / 1) times the mean
    ("sqrt", 4, 1.0),
    ("mean", 1, 1.0),
    ("linear", 1, 2.0),             # m/N: each update a fixed share 1/N (the paper's weight)
    ("linear", 4, 0.5),
])
def test_a_versions_step_follows_the_compass_step_rule(rule, step_updates, expected) -> None:
    """A version of two updates of 1.0 moves the model by version_step(2, rule, N) times
    their weighted mean, N = compass_step_updates (0: buffer_size)."""
    clock = Clock()
    core = _core(clock, compass_step=rule, compass_step_updates=step_updates)
    a, b = _join(core, "a", 10.0), _join(core, "b", 10.0)
    others = [_join(core, n, 0.1) for n in ("c", "d")]    # slow: their own groups
    tasks = [core.task(s) for s in (a, b, *others)]
    assert tasks[0].round == tasks[1].round != tasks[2].round
    clock.t = 1.0
    _push(core, a, 1.0, base=0, uid="a1")
    _push(core, b, 1.0, base=0, uid="b1")
    assert core.version == 1                              # two updates of four clients
    np.testing.assert_allclose(core.params, np.full(4, expected), rtol=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10_000), st.integers(1, 1_000))
def test_version_step_rules(count, reference) -> None:
    sqrt, mean, linear = (version_step(count, r, reference) for r in ("sqrt", "mean", "linear"))
    assert mean == 1.0 and linear == pytest.approx(count / reference)
    assert sqrt >= 1.0 and version_step(count + 1, "sqrt", reference) >= sqrt
    if count >= reference:
        # the step's noise (one update's / sqrt(count), times the step) is that of a mean of
        # `reference` updates, and it never outgrows the linear rule's
        assert sqrt / math.sqrt(count) == pytest.approx(1 / math.sqrt(reference))
        assert sqrt <= linear * (1 + 1e-12)
    else:
        assert sqrt == 1.0


def test_version_step_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="unknown compass step rule 'cube'"):
        version_step(3, "cube", 5)
    with pytest.raises(ValueError, match="count >= 1 and reference >= 1"):
        version_step(0, "sqrt", 5)
    with pytest.raises(ValueError, match="compass_step must be one of"):
        ServerConfig.from_flat(mode="compass", compass_max_steps=4, compass_step="cube")
    default = ServerConfig.from_flat(mode="compass", compass_max_steps=4)
    assert default.policy.compass_reference == default.policy.buffer_size == 10
    assert ServerConfig.from_flat(mode="compass", compass_max_steps=4, buffer_size=10,
                                  compass_step_updates=3).policy.compass_reference == 3


def test_a_scaled_up_version_stays_within_the_aggregates_range() -> None:
    """m/n > 1 scales a version up; the scale is held so that the aggregate stays within the
    fold bound the core proves finite (1e38 for float32: here two updates of mass 4e37)."""
    clock = Clock()
    core = _core(clock, compass_step="linear", compass_step_updates=1)
    a, b = _join(core, "a", 10.0), _join(core, "b", 10.0)
    core.task(a), core.task(b)
    clock.t = 1.0
    _push(core, a, 4e36, base=0, uid="a1")
    _push(core, b, 4e36, base=0, uid="b1")
    assert core.version == 1                               # 2x the mean would be 8e36
    np.testing.assert_allclose(core.params, np.full(4, 1.25 * 4e36), rtol=1e-5)
