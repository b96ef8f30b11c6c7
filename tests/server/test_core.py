"""The aggregator core: validation, policies, idempotency, checkpoints (no network)."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.aggregation import FedAvgOpt, FedBuff, Polynomial
from murmura.protocols import (
    Action,
    DeviceProfile,
    ModelSpec,
    TaskSettings,
    TensorSpec,
    UpdateHeader,
)
from murmura.server import (
    AggregatorCore,
    Checkpoint,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServerConfig,
    Unauthenticated,
    load_checkpoint,
    save_checkpoint,
)

SPEC = ModelSpec((TensorSpec("w", (2, 2)),))
P0 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_core(clock=None, **cfg) -> AggregatorCore:
    cfg.setdefault("min_clients", 2)
    cfg.setdefault("require_identity", False)  # legacy ids; tests/security covers identities
    return AggregatorCore(ServerConfig.from_flat(**cfg), SPEC, P0, clock=clock or Clock())


def push(core, session, update, *, uid=None, base=None, n=10, codec="dense-f32", round_=None,
         payload=None, fingerprint=None):
    payload = np.asarray(update, "<f4").tobytes() if payload is None else payload
    task_round = getattr(core.policy, "round", 0) if round_ is None else round_
    header = UpdateHeader(session=session, update_id=uid or f"u{np.random.randint(1 << 30)}",
                          base_version=core.version if base is None else base,
                          round=task_round, num_examples=n, codec=codec,
                          payload_bytes=len(payload),
                          spec_fingerprint=core.fingerprint if fingerprint is None
                          else fingerprint)
    return core.push(header, payload, wire_bytes=len(payload))


def joined(core, *ids):
    return [core.join(i, DeviceProfile()).session for i in ids]


def test_join_validates_identity_token_and_protocol() -> None:
    core = make_core(join_token="s3cret")
    with pytest.raises(InvalidArgument, match="client_id"):
        core.join("", DeviceProfile(), token="s3cret")
    with pytest.raises(PermissionDenied, match="token"):
        core.join("a", DeviceProfile(), token="wrong")
    with pytest.raises(FailedPrecondition, match="protocol 9"):
        core.join("a", DeviceProfile(), token="s3cret", protocol_version=9)
    result = core.join("a", DeviceProfile(), token="s3cret")
    assert result.mode == "sync" and result.settings == TaskSettings()


def test_sync_round_averages_cohort_updates_by_examples() -> None:
    core = make_core()
    a, b = joined(core, "a", "b")
    ta, tb = core.task(a), core.task(b)
    assert ta.action == tb.action == Action.TRAIN and ta.round == 1 and ta.seed != tb.seed
    push(core, a, [1, 1, 1, 1], n=10)
    assert core.version == 0 and core.task(a).action == Action.WAIT
    result = push(core, b, [4, 4, 4, 4], n=30)
    assert result.version == 1 and core.version == 1
    np.testing.assert_allclose(core.params, P0 + (10 * 1 + 30 * 4) / 40)


def test_sync_fold_order_does_not_depend_on_arrival_order(rng) -> None:
    ups = {c: rng.normal(size=4).astype(np.float32) * 10.0 ** rng.integers(-3, 3)
           for c in "abcde"}
    results = []
    for order in ("abcde", "edcba", "cadbe"):
        core = make_core(min_clients=5)
        sessions = dict(zip("abcde", joined(core, *"abcde"), strict=False))
        for c in "abcde":
            core.task(sessions[c])
        for c in order:
            push(core, sessions[c], ups[c], n=int(ord(c)))
        results.append(core.params.tobytes())
    assert results[0] == results[1] == results[2]


BAD_PUSHES = {
    "wrong length": (dict(payload=b"\0" * 12), InvalidArgument, "payload does not decode"),
    "nan": (dict(update=[0, np.nan, 0, 0]), InvalidArgument, "NaN or Inf"),
    "inf": (dict(update=[0, 0, np.inf, 0]), InvalidArgument, "first at index 2"),
    "future base": (dict(base=5), InvalidArgument, "in the future"),
    "unknown codec": (dict(codec="zip"), InvalidArgument, "unknown codec 'zip'"),
    "no examples": (dict(n=0), InvalidArgument, "num_examples"),
    "unknown round": (dict(round_=7), InvalidArgument, "round 7 has not started"),
}


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_bad_updates_are_refused_and_change_nothing(case) -> None:
    kwargs, error, message = BAD_PUSHES[case]
    core = make_core()
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    kwargs = {"update": [9, 9, 9, 9], **kwargs}
    with pytest.raises(error, match=message):
        push(core, a, **kwargs)
    assert core.version == 0 and core.params.tobytes() == P0.tobytes()
    assert core.policy.buffered() == 0 and core.traffic.updates == 0
    # the refused client may retry correctly, and the other client carries on
    push(core, a, [1, 1, 1, 1])
    push(core, b, [1, 1, 1, 1])
    assert core.version == 1
    np.testing.assert_allclose(core.params, P0 + 1)


def test_an_update_for_another_model_ends_the_session_and_the_round_goes_on() -> None:
    """No retry can fix a model mismatch: the session ends with the refusal, so the sync
    round does not wait for that client (it would never send an update the server takes)."""
    core = make_core()
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    with pytest.raises(FailedPrecondition, match="model spec .* the session is closed"):
        push(core, a, [9, 9, 9, 9], fingerprint="0123456789abcdef")
    assert core.active_client_ids() == ["b"]
    with pytest.raises(Unauthenticated, match="has ended"):
        core.task(a)
    push(core, b, [1, 1, 1, 1])  # the round closes on b alone
    assert core.version == 1
    np.testing.assert_allclose(core.params, P0 + 1)


def test_unknown_and_departed_sessions_are_unauthenticated() -> None:
    core = make_core(min_clients=1)
    (a,) = joined(core, "a")
    with pytest.raises(Unauthenticated, match="call Join first"):
        push(core, "nope", [0, 0, 0, 0])
    core.leave(a)
    with pytest.raises(Unauthenticated, match="has ended"):
        core.task(a)


def test_oversize_payload_is_resource_exhausted() -> None:
    core = make_core(min_clients=1, max_payload_mb=8 / (1 << 20))  # 8 bytes
    (a,) = joined(core, "a")
    core.task(a)
    with pytest.raises(ResourceExhausted, match="exceeds the limit of 8"):
        push(core, a, [1, 1, 1, 1])
    assert core.traffic.refused == {"RESOURCE_EXHAUSTED": 1}
    # a transport that refuses on the header alone (as the gRPC servicer does) counts it too
    header = UpdateHeader(session=a, update_id="big", base_version=0, round=0, num_examples=1,
                          codec="dense-f32", payload_bytes=16,
                          spec_fingerprint=core.fingerprint)
    with pytest.raises(ResourceExhausted):
        core.precheck(header)
    assert core.traffic.refused == {"RESOURCE_EXHAUSTED": 2}


def test_a_retried_push_is_counted_once() -> None:
    core = make_core(min_clients=2)
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    first = push(core, a, [2, 2, 2, 2], uid="same")
    again = push(core, a, [2, 2, 2, 2], uid="same")
    assert not first.duplicate and again.duplicate
    assert core.traffic.updates == 1 and core.policy.buffered() == 1
    push(core, b, [0, 0, 0, 0], n=10)
    np.testing.assert_allclose(core.params, P0 + 1)


def test_a_client_may_not_answer_a_round_twice_or_uninvited() -> None:
    core = make_core(min_clients=2, cohort_size=2)
    a, b = joined(core, "a", "b")
    core.task(a)
    push(core, a, [1, 1, 1, 1])
    with pytest.raises(FailedPrecondition, match="already sent"):
        push(core, a, [1, 1, 1, 1])
    (c,) = joined(core, "c")
    with pytest.raises(FailedPrecondition, match="not in the cohort"):
        push(core, c, [1, 1, 1, 1])


def test_deadline_closes_the_round_and_late_updates_count_as_stale() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=3, round_deadline_s=10, staleness="polynomial",
                     staleness_exponent=1.0)
    a, b, c = joined(core, "a", "b", "c")
    for s in (a, b, c):
        core.task(s)
    push(core, a, [2, 2, 2, 2])
    clock.t = 11
    core.tick()
    assert core.version == 1  # closed with the one update that arrived
    np.testing.assert_allclose(core.params, P0 + 2)
    push(core, b, [4, 4, 4, 4], base=0, round_=1)  # late: staleness 1, weight 1/2
    assert core.traffic.updates == 2 and core.policy.buffered() == 1
    for s in (a, b, c):
        assert core.task(s).round == 2
    for s in (a, b, c):
        push(core, s, [0, 0, 0, 0])
    # round 2: (0.5 * 10 * 4 + 0 + 0 + 0) / 40 = 0.5
    np.testing.assert_allclose(core.params, P0 + 2 + 0.5)


def test_too_stale_updates_are_refused() -> None:
    clock = Clock()
    core = make_core(clock, min_clients=1, max_staleness=0, round_deadline_s=1)
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    push(core, a, [1, 1, 1, 1])
    clock.t = 2
    core.tick()
    with pytest.raises(FailedPrecondition, match="1 versions old"):
        push(core, b, [1, 1, 1, 1], base=0, round_=1)


def test_a_member_leaving_mid_round_does_not_block_it() -> None:
    core = make_core(min_clients=2)
    a, b = joined(core, "a", "b")
    core.task(a), core.task(b)
    push(core, a, [3, 3, 3, 3])
    core.leave(b)
    assert core.version == 1


def test_async_policy_publishes_every_k_updates_with_staleness() -> None:
    core = make_core(mode="async", buffer_size=2, staleness="constant")
    a, b = joined(core, "a", "b")
    assert core.task(a).action == Action.TRAIN
    push(core, a, [1, 1, 1, 1])
    assert core.version == 0
    push(core, b, [3, 3, 3, 3])
    assert core.version == 1
    np.testing.assert_allclose(core.params, P0 + 2)
    r = push(core, a, [1, 1, 1, 1], base=0)
    assert r.staleness == 1


def test_the_async_core_publishes_what_fedbuff_computes(rng) -> None:
    # The server folds on its publisher thread but through FedBuff's own admit/emptied rules,
    # so its versions are FedBuff.add/flush's aggregates, stale updates included.
    core = make_core(mode="async", buffer_size=3, max_staleness=3, server_lr=1.0,
                     optimizer="fedavg")
    sessions = joined(core, "a", "b", "c")
    buf = FedBuff(4, buffer_size=3, max_staleness=3, staleness=Polynomial(0.5))
    want = P0.copy()
    bases = [0, 0, 0, 1, 0, 1, 2, 1, 0]  # version k+1 is published after pushes 3k..3k+2
    for i, base in enumerate(bases):
        update = rng.normal(size=4).astype(np.float32)
        n = int(rng.integers(1, 20))
        r = push(core, sessions[i % 3], update, base=base, n=n)
        assert r.staleness == core.version - base - (1 if (i + 1) % 3 == 0 else 0)
        if buf.add(update, float(n), r.staleness):
            want = FedAvgOpt(lr=1.0).step(want, buf.flush())
        assert core.policy.buffered() == buf.count
    assert core.version == 3
    assert core.params.tobytes() == want.tobytes()


def test_finished_run_says_stop_and_refuses_updates() -> None:
    core = make_core(mode="async", buffer_size=1, max_versions=1)
    (a,) = joined(core, "a")
    push(core, a, [1, 1, 1, 1])
    assert core.done and core.task(a).action == Action.STOP
    with pytest.raises(FailedPrecondition, match="finished"):
        push(core, a, [1, 1, 1, 1])


def test_rejoin_takes_over_the_identity() -> None:
    core = make_core(min_clients=1)
    (old,) = joined(core, "a")
    (new,) = joined(core, "a")
    assert old != new and core.active_client_ids() == ["a"]
    with pytest.raises(Unauthenticated):
        core.task(old)


def test_checkpoint_is_written_per_version_and_resumes(tmp_path) -> None:
    path = tmp_path / "ckpt.npz"
    cfg = dict(mode="async", buffer_size=1, optimizer="fedavgm", max_versions=10,
               require_identity=False)
    core = AggregatorCore(ServerConfig.from_flat(**cfg), SPEC, P0, checkpoint_path=path)
    (a,) = joined(core, "a")
    push(core, a, [1, 1, 1, 1])
    push(core, a, [1, 1, 1, 1])
    ckpt = load_checkpoint(path)
    assert ckpt.version == 2 and ckpt.params.tobytes() == core.params.tobytes()
    assert set(ckpt.optimizer_state) == {"momentum"}
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temporary file
    resumed = AggregatorCore(ServerConfig.from_flat(**cfg), SPEC, P0, start=ckpt)
    (b,) = joined(resumed, "b")
    push(resumed, b, [1, 1, 1, 1])
    push(core, a, [1, 1, 1, 1])
    assert resumed.version == core.version == 3
    assert resumed.params.tobytes() == core.params.tobytes()  # momentum came back too


def test_checkpoint_for_another_model_or_corrupt_file_is_refused(tmp_path) -> None:
    other = tmp_path / "other.npz"
    save_checkpoint(other, Checkpoint(1, np.zeros(3, np.float32), "feedfacefeedface"))
    with pytest.raises(ValueError, match="model spec"):
        AggregatorCore(ServerConfig(), SPEC, P0, start=load_checkpoint(other))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(bad)


def test_server_config_refuses_broken_settings() -> None:
    with pytest.raises(ValueError, match="mode"):
        ServerConfig.from_flat(mode="semi")
    with pytest.raises(ValueError, match="no round could ever start"):
        ServerConfig.from_flat(cohort_size=2, min_clients=3)
    with pytest.raises(ValueError, match="unknown optimizer"):
        ServerConfig.from_flat(optimizer="lbfgs")


def test_an_update_arriving_while_a_version_is_being_published_counts_it_in_its_staleness(
        ) -> None:
    # Under load the publisher lags: version 1 is made but not installed when the next update
    # (trained on version 0) arrives. That update steps version 1's model, so it is one version
    # stale; counting installed versions only gave it a fresh update's full weight, and a
    # loaded async run stepped the same old deltas in several versions in a row.
    core = make_core(mode="async", buffer_size=2, max_versions=5, staleness="polynomial",
                     staleness_exponent=1.0)
    installs: list = []
    core.post = installs.append  # installs wait, as they do behind a busy event loop
    a, b, c = joined(core, "a", "b", "c")
    for s in (a, b, c):
        core.task(s)
    push(core, a, [1.0, 1.0, 1.0, 1.0], base=0)
    push(core, b, [1.0, 1.0, 1.0, 1.0], base=0)  # fills the buffer: version 1 is published
    assert core.publishing == 1 and core.version == 0 and len(installs) == 1
    late = push(core, c, [1.0, 1.0, 1.0, 1.0], base=0)
    assert late.staleness == 1
    for install in installs:
        install()
    assert core.version == 1 and core.publishing == 0
    assert core.staleness_of(0) == 1 and core.staleness_of(1) == 0
