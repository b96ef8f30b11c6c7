"""The MoDeST round's rules (gossip/modest_core.py): the spec deployed peers and the simulator
both follow. Small, deterministic, no transport and no clock."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.gossip import FailedPrecondition, GossipConfig, InvalidArgument, modest_sample
from murmura.gossip.errors import ResourceExhausted
from murmura.gossip.modest_core import (
    AGGREGATE,
    FINISH,
    TRAIN,
    TRAINED,
    ModestPlan,
    ModestState,
    merge,
    rank_of,
)
from murmura.gossip.node import Received

IDS = [f"peer-{i:03d}" for i in range(12)]
PLAN = ModestPlan(seed=5, sample_size=3, aggregators=2)
SIZE = 4


def _vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def _state(me: str, *, plan: ModestPlan = PLAN, limit: int = 64,
           timeout: float = 10.0) -> ModestState:
    return ModestState(me, plan, inbox_limit=limit, round_timeout_s=timeout)


def _ranked(round_: int, role: str, members: list[str] = IDS) -> list[str]:
    return sorted(members, key=lambda p: rank_of(p, round_, role, members, seed=PLAN.seed))


# -- samples


def test_samples_are_the_head_of_each_roles_hash_ranking() -> None:
    for r in range(4):
        assert PLAN.trainers_of(r, IDS) == _ranked(r, TRAIN)[:3]
        assert PLAN.aggregators_of(r, IDS) == _ranked(r, AGGREGATE)[:2]
        assert PLAN.trainers_of(r, IDS[::-1]) == PLAN.trainers_of(r, IDS)  # any order known
    assert len({tuple(PLAN.trainers_of(r, IDS)) for r in range(6)}) > 1  # fresh each round
    assert ModestPlan.from_config(GossipConfig(topology="modest", seed=5, sample_size=3,
                                               aggregators=2)) == PLAN


def test_a_member_that_is_down_is_replaced_by_the_next_in_the_ranking() -> None:
    first, *rest = PLAN.trainers_of(2, IDS)
    up = [p for p in IDS if p != first]

    assert PLAN.trainers_of(2, up) == [*rest, _ranked(2, TRAIN)[3]]
    assert PLAN.trainers_of(2, IDS[:2]) == modest_sample(2, IDS[:2], 3, seed=5)  # fewer: all


def test_trained_models_go_to_the_rounds_aggregators_and_aggregates_to_the_next_trainers(
        ) -> None:
    end = 3
    assert PLAN.recipients(TRAINED, 1, IDS, end) == PLAN.aggregators_of(1, IDS)
    assert PLAN.recipients(AGGREGATE, 2, IDS, end) == PLAN.trainers_of(2, IDS)
    assert PLAN.recipients(AGGREGATE, end, IDS[::-1], end) == IDS  # the final: everyone


# -- what a receiver accepts


def test_roles_are_accepted_up_to_twice_the_samples_size_deep() -> None:
    ranked = _ranked(4, AGGREGATE)
    assert [PLAN.within(p, 4, AGGREGATE, IDS) for p in ranked[:5]] == [True] * 4 + [False]
    ranked = _ranked(4, TRAIN)
    assert [PLAN.within(p, 4, TRAIN, IDS) for p in ranked[:7]] == [True] * 6 + [False]


def _aggregator_and_trainer(round_: int) -> tuple[str, str, str, str]:
    """(an aggregator, a trainer, a peer too deep to aggregate, too deep to train)."""
    return (_ranked(round_, AGGREGATE)[0], _ranked(round_, TRAIN)[0],
            _ranked(round_, AGGREGATE)[-1], _ranked(round_, TRAIN)[-1])


@pytest.mark.parametrize(("kind", "round_", "who", "error", "match"), [
    (TRAINED, 5, "ok", InvalidArgument, "round must be 0..4"),
    (TRAINED, 1, "not-aggregator", FailedPrecondition, "does not aggregate round 1"),
    (TRAINED, 1, "not-trainer", FailedPrecondition, "does not train round 1"),
    (AGGREGATE, 0, "ok", InvalidArgument, "round must be 1..5"),
    (AGGREGATE, 6, "ok", InvalidArgument, "round must be 1..5"),
    (AGGREGATE, 2, "not-trainer", FailedPrecondition, "this peer does not train round 2"),
    (AGGREGATE, 2, "not-aggregator", FailedPrecondition, "does not aggregate round 1"),
    ("mixing", 1, "ok", InvalidArgument, "kind must be one of"),
])
def test_messages_that_do_not_fit_the_roles_are_refused(
        kind: str, round_: int, who: str, error: type[Exception], match: str) -> None:
    end = 5
    agg_r, train_r, deep_agg_r, deep_train_r = _aggregator_and_trainer(round_)
    agg_prev, _, deep_agg_prev, _ = _aggregator_and_trainer(round_ - 1)
    if kind == TRAINED:
        me, sender = {"ok": (agg_r, train_r), "not-aggregator": (deep_agg_r, train_r),
                      "not-trainer": (agg_r, deep_train_r)}[who]
    else:
        me, sender = {"ok": (train_r, agg_prev), "not-trainer": (deep_train_r, agg_prev),
                      "not-aggregator": (train_r, deep_agg_prev)}[who]
    state = _state(me)

    with pytest.raises(error, match=match):
        state.accept(sender, kind, round_, "m1", _vec(1, 2, 3, 4), 1, members=IDS, end=end,
                     now=0.0)
    assert not state.box


def test_the_final_aggregate_fits_any_peer_and_a_repeat_is_a_duplicate() -> None:
    end = 3
    sender = PLAN.aggregators_of(end - 1, IDS)[0]
    me = _ranked(end, TRAIN)[-1]  # trains nothing, still gets the final model
    state = _state(me)

    assert state.accept(sender, AGGREGATE, end, "m1", _vec(1, 1, 1, 1), 0, members=IDS,
                        end=end, now=0.0)
    assert not state.accept(sender, AGGREGATE, end, "m1", _vec(1, 1, 1, 1), 0, members=IDS,
                            end=end, now=1.0)
    assert state.due(end) == (FINISH, end)


# -- a peer's progress


def test_only_round_0s_trainers_start_from_the_runs_model() -> None:
    model = _vec(1, 2, 3, 4)
    trainer, other = PLAN.trainers_of(0, IDS)[0], _ranked(0, TRAIN)[-1]
    a, b = _state(trainer), _state(other)

    assert a.start(model, IDS, 3, now=0.0) and not b.start(model, IDS, 3, now=0.0)
    assert a.due(3) == (TRAIN, 0) and b.due(3) is None
    model[0] = 9  # kept as a copy
    assert a.take(TRAIN, 0)[0].model[0] == 1 and not a.box


def test_steps_come_in_round_order_training_before_aggregating() -> None:
    state = _state("peer-000")
    for kind, round_ in [(TRAINED, 2), (AGGREGATE, 2), (TRAINED, 1), (AGGREGATE, 3)]:
        state.keep("peer-001", kind, round_, "", _vec(0, 0, 0, 0), 1, now=0.0)

    assert state.due(3) == (AGGREGATE, 1)
    state.take(AGGREGATE, 1)
    state.acted(AGGREGATE, 1)
    assert state.due(3) == (TRAIN, 2)
    state.take(TRAIN, 2)
    state.acted(TRAIN, 2)
    assert state.due(3) == (AGGREGATE, 2)
    state.take(AGGREGATE, 2)
    assert state.due(3) == (FINISH, 3)


def test_models_for_a_round_a_peer_has_acted_in_are_dropped_and_refused() -> None:
    r = 1
    me, sender = PLAN.aggregators_of(r, IDS)[0], PLAN.trainers_of(r, IDS)[0]
    state = _state(me)
    state.keep(sender, TRAINED, r, "", _vec(0, 0, 0, 0), 1, now=0.0)
    state.acted(AGGREGATE, r)

    assert state.due(5) is None and not state.box  # a late one: dropped
    with pytest.raises(FailedPrecondition, match="is over at this peer"):
        state.accept(sender, TRAINED, r, "m2", _vec(0, 0, 0, 0), 1, members=IDS, end=5,
                     now=0.0)
    state.keep(sender, TRAINED, 4, "", _vec(0, 0, 0, 0), 1, now=0.0)
    assert state.due(4) is None  # a trained model of round >= end never gets aggregated


def test_a_full_inbox_refuses_new_models_but_takes_a_senders_resend() -> None:
    state = _state("peer-000", limit=2)
    state.keep("peer-001", TRAINED, 0, "", _vec(0, 0, 0, 0), 1, now=0.0)
    state.keep("peer-002", TRAINED, 0, "", _vec(0, 0, 0, 0), 1, now=0.0)

    state.keep("peer-001", TRAINED, 0, "", _vec(1, 1, 1, 1), 1, now=0.0)  # replaces its own
    with pytest.raises(ResourceExhausted):
        state.keep("peer-003", TRAINED, 0, "", _vec(0, 0, 0, 0), 1, now=0.0)
    assert state.box[(TRAINED, 0)].models["peer-001"].model[0] == 1


def test_a_step_waits_for_its_expected_models_or_the_timeout_from_the_first() -> None:
    r = 2
    me = PLAN.aggregators_of(r, IDS)[0]
    trainers = PLAN.trainers_of(r, IDS)
    state = _state(me, timeout=10.0)
    expected = PLAN.expected(AGGREGATE, r, IDS)
    assert expected == len(trainers) == 3

    for t, now in zip(reversed(trainers[1:]), (100.0, 104.0), strict=True):
        state.keep(t, TRAINED, r, "", _vec(0, 0, 0, 0), 1, now=now)
    assert state.wait_s(AGGREGATE, r, expected, now=104.0) == 6.0  # from the first, at 100
    assert state.wait_s(AGGREGATE, r, expected, now=111.0) == 0.0  # timed out: go with 2
    state.keep(trainers[0], TRAINED, r, "", _vec(0, 0, 0, 0), 1, now=105.0)
    assert state.wait_s(AGGREGATE, r, expected, now=105.0) == 0.0  # all came

    got = state.take(AGGREGATE, r)
    assert [g.sender for g in got] == sorted(trainers) and not state.box


def test_how_many_aggregates_a_trainer_waits_for() -> None:
    assert PLAN.expected(TRAIN, 0, IDS) == 1  # the run's starting model
    assert PLAN.expected(TRAIN, 3, IDS) == PLAN.expected(FINISH, 3, IDS) == 2
    assert PLAN.expected(TRAIN, 3, IDS[:1]) == 1  # a network smaller than the sample
    assert PLAN.expected(AGGREGATE, 3, IDS[:2]) == 2


# -- what aggregators and trainers make of the models they get


def test_an_aggregate_is_the_rule_over_sender_order_weighted_by_examples() -> None:
    got = [Received("peer-002", 0, _vec(4, 4, 4, 4), 3), Received("peer-001", 0,
           _vec(0, 0, 0, 8), 1), Received("peer-003", 0, _vec(1, 2, 3, 4), 0)]

    out = PLAN.aggregate(got, SIZE)

    assert out.dtype == np.float32
    np.testing.assert_allclose(out, (3 * got[0].model + got[1].model + got[2].model) / 5,
                               rtol=1e-6)  # no examples: weight 1
    median = ModestPlan(rule="median").aggregate(got, SIZE)
    np.testing.assert_array_equal(median, _vec(1, 2, 3, 4))


def test_an_aggregate_does_not_depend_on_the_order_models_arrived_in() -> None:
    rng = np.random.default_rng(1)
    got = [Received(f"peer-{i:03d}", 0, rng.standard_normal(256).astype(np.float32), 1 + i)
           for i in range(6)]

    out = PLAN.aggregate(got, 256)

    assert PLAN.aggregate(got[::-1], 256).tobytes() == out.tobytes()
    assert PLAN.aggregate(got[3:] + got[:3], 256).tobytes() == out.tobytes()


def test_merging_aggregates_is_their_mean_in_sender_order() -> None:
    rng = np.random.default_rng(0)
    aggs = [Received(f"peer-{i:03d}", 1, rng.standard_normal(64).astype(np.float32), 0)
            for i in range(5)]

    out = merge(aggs)

    assert out.dtype == np.float32
    assert out.tobytes() == np.mean(np.stack([a.model for a in aggs]), axis=0) \
        .astype(np.float32).tobytes()
    assert merge(aggs[::-1]).tobytes() == out.tobytes()
    np.testing.assert_array_equal(merge(aggs[:1]), aggs[0].model)


# -- the whole relay


def _train(peer: str, round_: int, start: np.ndarray) -> tuple[np.ndarray, int]:
    """A stand-in trainer: a fixed step per (peer, round), a peer-dependent example count."""
    i = IDS.index(peer)
    step = np.sin(np.arange(SIZE, dtype=np.float32) * (i + 1) + round_).astype(np.float32)
    return (start + np.float32(0.1) * step).astype(np.float32), 1 + i % 4


def _relay(plan: ModestPlan, members: list[str], end: int, start: np.ndarray
           ) -> dict[str, np.ndarray]:
    """Every peer runs a ModestState; messages are handed over at once (a deployed peer's
    sends, minus the network). Returns each peer's final model."""
    states = {p: _state(p, plan=plan) for p in members}
    for s in states.values():
        s.start(start, members, end, now=0.0)
    finals: dict[str, np.ndarray] = {}

    def send(sender: str, kind: str, round_: int, model: np.ndarray, n: int) -> None:
        for t in plan.recipients(kind, round_, members, end):
            if t == sender:
                states[t].keep(t, kind, round_, "", model.copy(), n, now=0.0)
            else:
                assert states[t].accept(sender, kind, round_, f"{sender}/{kind}/{round_}",
                                        model.copy(), n, members=members, end=end, now=0.0)

    while True:
        ready = [(p, s.due(end)) for p, s in states.items()]
        ready = [(p, d) for p, d in ready if d is not None
                 and states[p].wait_s(*d, plan.expected(*d, members), now=0.0) == 0]
        if not ready:
            break
        peer, (step, r) = min(ready, key=lambda x: (x[1][1], x[1][0] != TRAIN, x[0]))
        state = states[peer]
        got = state.take(step, r)
        if step == FINISH:
            finals[peer] = merge(got)
            state.finished = True
        elif step == TRAIN:
            state.acted(TRAIN, r)
            send(peer, TRAINED, r, *_train(peer, r, merge(got)))
        else:
            state.acted(AGGREGATE, r)
            send(peer, AGGREGATE, r + 1, plan.aggregate(got, SIZE), 0)
    assert all(not s.box for s in states.values())
    return finals


def _rounds(plan: ModestPlan, members: list[str], end: int, start: np.ndarray) -> np.ndarray:
    """The synchronous rounds the simulator runs: T_r train from the mean of A_{r-1}'s
    aggregates, every aggregator of A_r aggregates all of T_r's models."""
    model = start
    for r in range(end):
        trained = [Received(t, r, *_train(t, r, model)) for t in plan.trainers_of(r, members)]
        aggs = [Received(a, r + 1, plan.aggregate(trained, SIZE), 0)
                for a in plan.aggregators_of(r, members)]
        model = merge(aggs)
    return model


@pytest.mark.parametrize("plan", [PLAN, ModestPlan(seed=1, sample_size=4, aggregators=3,
                                                   rule="trimmed-mean",
                                                   rule_options={"trim": "0.25"})])
def test_the_message_driven_relay_ends_where_the_synchronous_rounds_do(
        plan: ModestPlan) -> None:
    members = IDS[:7]
    start = np.linspace(-1, 1, SIZE, dtype=np.float32)

    finals = _relay(plan, members, 4, start)
    expected = _rounds(plan, members, 4, start)

    assert sorted(finals) == members  # everyone gets the final model
    for model in finals.values():
        assert model.tobytes() == expected.tobytes()
    assert not np.array_equal(expected, start)
