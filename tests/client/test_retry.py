"""RetryPolicy, the one backoff: its pauses, and the loops that wait them (the client runtime,
the simulator's virtual clients)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from murmura.client import ClientRuntime, FunctionTrainer, RemoteError, RetryPolicy, jitter_rng
from murmura.protocols import TaskSettings
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.errors import ResourceExhausted, Unavailable
from murmura.simulation import Simulation, SimulationConfig, prepare_server
from murmura.tasks import TaskConfig
from tests.client.core_transport import CoreTransport


def _pauses(policy: RetryPolicy, n: int, *, seed: int = 0, hint: float | None = None
            ) -> list[float]:
    """The first ``n`` pauses of a backoff whose tries all fail at once (the clock moves only
    by the pauses)."""
    backoff, now, out = policy.start(0.0, random.Random(seed)), 0.0, []
    for _ in range(n):
        pause = backoff.next_pause(now, hint)
        assert pause is not None
        out.append(pause)
        now += pause
    return out


# -- the policy ---------------------------------------------------------------------------


def test_pauses_grow_by_the_multiplier_up_to_the_cap() -> None:
    policy = RetryPolicy(initial_s=0.1, multiplier=2.0, max_s=1.0, jitter=0.0)
    assert _pauses(policy, 7) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_jitter_stays_within_its_band_and_a_seed_repeats_it() -> None:
    policy = RetryPolicy(initial_s=1.0, multiplier=1.0, max_s=1.0, jitter=0.25)
    pauses = _pauses(policy, 200, seed=3)
    assert all(0.75 <= p <= 1.25 for p in pauses)
    assert max(pauses) - min(pauses) > 0.3  # spread over the band, not a constant
    assert _pauses(policy, 200, seed=3) == pauses  # bit for bit
    assert _pauses(policy, 200, seed=4) != pauses


def test_a_client_ids_jitter_stream_is_a_function_of_the_id() -> None:
    policy = RetryPolicy(jitter=0.5)
    a = policy.start(0.0, jitter_rng("client-007")).next_pause(0.0)
    b = policy.start(0.0, jitter_rng("client-007")).next_pause(0.0)
    c = policy.start(0.0, jitter_rng("client-008")).next_pause(0.0)
    assert a == b != c


def test_a_retry_hint_longer_than_the_backoff_wins_a_shorter_one_changes_nothing() -> None:
    policy = RetryPolicy(initial_s=0.2, max_s=5.0, jitter=0.2)
    assert _pauses(policy, 3, hint=2.5) == [2.5, 2.5, 2.5]
    assert _pauses(policy, 3, hint=0.01) == _pauses(policy, 3)
    # the hint does not hold back the growth: the backoff goes on past it
    assert _pauses(policy, 6, hint=1.0)[-1] > 1.0


def test_it_gives_up_at_the_deadline_with_the_last_try_on_it() -> None:
    policy = RetryPolicy(initial_s=1.0, multiplier=2.0, max_s=4.0, jitter=0.0,
                         give_up_after_s=10.0)
    backoff, now, pauses = policy.start(100.0), 100.0, []
    while (pause := backoff.next_pause(now)) is not None:
        pauses.append(pause)
        now += pause
    # 1 + 2 + 4 = 7 s; the next 4 s pause is cut to end on the deadline, then no more
    assert pauses == [1.0, 2.0, 4.0, 3.0] and now == 110.0 == backoff.deadline
    assert backoff.attempts == 4
    assert backoff.next_pause(now) is None  # it stays given up


def test_a_failure_after_the_deadline_or_a_hint_past_it_gives_up() -> None:
    policy = RetryPolicy(give_up_after_s=10.0)
    assert policy.start(0.0).next_pause(10.5) is None  # the try itself took too long
    assert policy.start(0.0).next_pause(5.0, retry_after_s=6.0) is None  # can't wait that long
    assert policy.start(0.0).next_pause(5.0, retry_after_s=5.0) == 5.0  # just can
    assert RetryPolicy(give_up_after_s=0.0).start(0.0).next_pause(0.0) is None  # no retries


def test_the_policy_computes_and_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sleep(s: float) -> None:
        raise AssertionError(f"RetryPolicy slept {s}s")

    monkeypatch.setattr(time, "sleep", no_sleep)
    policy = RetryPolicy(initial_s=60.0, max_s=3600.0, give_up_after_s=1e9)
    t0 = time.perf_counter()
    pauses = _pauses(policy, 1000, hint=30.0)
    assert time.perf_counter() - t0 < 1.0  # about 17 days of pauses, computed at once
    assert sum(pauses) > 1e6


@pytest.mark.parametrize("bad", [
    {"initial_s": 0.0}, {"initial_s": 2.0, "max_s": 1.0}, {"multiplier": 0.5},
    {"jitter": 1.0}, {"jitter": -0.1}, {"give_up_after_s": -1.0},
])
def test_a_policy_that_cannot_back_off_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="retry policy"):
        RetryPolicy(**bad)


# -- the loops that use it ----------------------------------------------------------------


class BusyOnce(CoreTransport):
    """The real core behind a transport whose first push is refused with a retry hint, as the
    gRPC transport reports a busy server (RESOURCE_EXHAUSTED + murmura-retry-after-ms)."""

    def __init__(self, core, hint: float) -> None:
        super().__init__(core)
        self.hint: float | None = hint

    def push(self, header, payload):
        if self.hint is not None:
            hint, self.hint = self.hint, None
            raise RemoteError("RESOURCE_EXHAUSTED", "busy", retry_after_s=hint)
        return super().push(header, payload)


def _one_version() -> tuple[FunctionTrainer, AggregatorCore]:
    trainer = FunctionTrainer(torch.nn.Linear(2, 1), lambda m, s, seed: {"num_examples": 1})
    core = AggregatorCore(ServerConfig.from_flat(mode="async", buffer_size=1, max_versions=1,
                                                 min_clients=1, require_identity=False),
                          trainer.spec, trainer.spec.flatten(trainer.model))
    return trainer, core


def test_the_client_runtime_waits_as_long_as_a_busy_server_asks() -> None:
    trainer, core = _one_version()
    pauses: list[float] = []
    rt = ClientRuntime(BusyOnce(core, hint=3.0), trainer, client_id="c1", wait_s=0,
                       sleep=pauses.append, retry=RetryPolicy(initial_s=0.1))
    stats = rt.run()
    assert pauses == [3.0] and stats.retries == 1 and stats.pushed == 1 and core.version == 1


def _runtime_pauses(client_id: str, failures: list[str]) -> list[float]:
    """The pauses of a ClientRuntime of ``client_id`` whose first calls fail so."""
    trainer, core = _one_version()
    transport = CoreTransport(core)
    transport.failures = list(failures)
    pauses: list[float] = []
    ClientRuntime(transport, trainer, client_id=client_id, wait_s=0,
                  sleep=pauses.append).run()
    return pauses


def _engine() -> Simulation:
    sim = SimulationConfig(clients=2, speed_spread=4.0, vectorise="off", workers=1)
    train = TaskSettings(local_epochs=1, batch_size=32)
    server = prepare_server(ServerConfig.from_flat(mode="async", max_versions=5, buffer_size=2,
                                                   train=train), sim)
    return Simulation(TaskConfig(task="digits", model="logreg", partition="iid"), server, sim,
                      out_dir=None, evaluate=False)


def _refuse_first_push(engine: Simulation, error: Exception) -> tuple[list, list[float]]:
    """Make the core refuse client 0's first push with ``error``; record (time, client, update
    id) of every push and the time of the refusal."""
    pushes: list[tuple[float, str, str]] = []
    refused: list[float] = []
    core_push = engine.core.pipeline.push

    def push(header, payload, **kw):
        client = engine.core._record(header.session).client_id
        pushes.append((engine.clock.now, client, header.update_id))
        if client == engine.ids[0] and not refused:
            refused.append(engine.clock.now)
            raise error
        return core_push(header, payload, **kw)

    engine.core.pipeline.push = push  # type: ignore[method-assign]
    return pushes, refused


def _client0(pushes: list[tuple[float, str, str]], engine: Simulation) -> list[tuple[float, str]]:
    return [(t, uid) for t, cid, uid in pushes if cid == engine.ids[0]]


def test_a_virtual_client_retries_no_sooner_than_a_busy_servers_hint(one_torch_thread) -> None:
    # Prepare: client 0's first push meets a busy server that asks for 4 s
    engine = _engine()
    pushes, refused = _refuse_first_push(engine, ResourceExhausted("busy", retry_after_s=4.0))
    # Execute
    engine.run()
    # Assert: the same update again 4 s later (the backoff alone would be ~0.2 s)
    mine = _client0(pushes, engine)
    assert mine[1][1] == mine[0][1]
    assert mine[1][0] - refused[0] == pytest.approx(4.0)
    assert engine.refused["RESOURCE_EXHAUSTED"] == 1 and engine.gave_up == 0


def test_a_virtual_clients_jitter_is_the_deployed_clients_and_reruns_repeat_it(
        one_torch_thread) -> None:
    # Prepare: the same run twice, client 0's first push meeting an unavailable server
    runs = []
    for _ in range(2):
        engine = _engine()
        pushes, refused = _refuse_first_push(engine, Unavailable("restarting"))
        # Execute
        result = engine.run()
        runs.append((_client0(pushes, engine), refused, result.params.tobytes()))
    # Assert: the pause is the first one a ClientRuntime of that id draws, jittered
    mine, refused, _ = runs[0]
    expected = _runtime_pauses(engine.ids[0], ["UNAVAILABLE"])[0]
    assert expected != engine.retry.initial_s
    assert expected == engine.retry.start(0.0, jitter_rng(engine.ids[0])).next_pause(0.0)
    assert mine[1][0] - refused[0] == pytest.approx(expected)
    assert runs[1] == runs[0]  # bit-identical rerun: times, update ids, final model
