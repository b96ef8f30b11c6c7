"""Attacks in the engine: per-client attacks (a deployed malicious client's ``Attack``), the
harness hook over training batches, and the client's refusal rules in virtual time."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.client import attacks as attack_fns
from murmura.client.malicious import Attack, make_attack
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, ServiceError
from murmura.server.errors import Unavailable
from murmura.simulation import Simulation, SimulationConfig, UpdateBatch, prepare_server
from murmura.tasks import TaskConfig, load_task

LOGREG = TaskConfig(task="digits", model="logreg", partition="iid")
SETTINGS = TaskSettings(local_epochs=1, batch_size=32)
FLIP = {"source": "1", "target": "7"}


class Recorder:
    """An update hook that replaces nothing and keeps a copy of every batch."""

    def __init__(self) -> None:
        self.batches: list[UpdateBatch] = []

    def __call__(self, batch: UpdateBatch) -> None:
        self.batches.append(batch)

    def first(self) -> dict[int, np.ndarray]:
        """The first batch's updates by client (every client trained from version 0)."""
        b = self.batches[0]
        assert set(b.versions) == {0}
        return dict(zip(b.clients, b.updates, strict=True))


def _engine(mode: str = "sync", clients: int = 4, versions: int = 1, vectorise: str = "off",
            **kw) -> Simulation:
    sim = SimulationConfig(clients=clients, speed_spread=1.0 if mode == "sync" else 4.0,
                           vectorise=vectorise, workers=1)
    server = prepare_server(ServerConfig.from_flat(mode=mode, max_versions=versions, buffer_size=2,
                                                   train=SETTINGS), sim)
    return Simulation(LOGREG, server, sim, out_dir=None, evaluate=False, **kw)


@pytest.mark.parametrize("vectorise", ["off", "on"])
def test_a_label_flipping_client_trains_on_its_own_share_relabelled(vectorise: str) -> None:
    # Prepare: the same run twice, client 1 flipping 1s to 7s in the second
    honest, flipped = Recorder(), Recorder()
    _engine(vectorise=vectorise, update_hook=honest).run()
    engine = _engine(vectorise=vectorise, update_hook=flipped,
                     attacks={1: make_attack("label-flip", FLIP)})
    # Execute
    engine.run()
    # Assert: client 1's update differs; everyone else's is bit-identical
    a, b = honest.first(), flipped.first()
    assert a[1].tobytes() != b[1].tobytes()
    assert all(a[c].tobytes() == b[c].tobytes() for c in (0, 2, 3))
    # its share is its own examples with the labels a real malicious client would use
    own = load_task(LOGREG).client_data(1, 4)
    poisoned = engine.data.train.subset(engine.data.shares[1])
    assert (own.y == 1).any()
    np.testing.assert_array_equal(poisoned.x, own.x)
    np.testing.assert_array_equal(poisoned.y, attack_fns.flip_labels(own.y, 1, 7))
    for c in (0, 2, 3):
        np.testing.assert_array_equal(engine.data.train.subset(engine.data.shares[c]).y,
                                      load_task(LOGREG).client_data(c, 4).y)


def test_an_update_attack_applies_to_exactly_the_listed_clients() -> None:
    # Prepare
    honest, attacked = Recorder(), Recorder()
    _engine(update_hook=honest).run()
    engine = _engine(update_hook=attacked, attacks={
        1: make_attack("sign-flip", {"scale": "3"}), 3: Attack(update=lambda u: 2 * u),
        2: Attack()})  # an honest "attack" is no attack
    # Execute
    engine.run()
    # Assert
    a, b = honest.first(), attacked.first()
    np.testing.assert_array_equal(b[1], -3 * a[1])
    np.testing.assert_array_equal(b[3], 2 * a[3])
    assert a[0].tobytes() == b[0].tobytes() and a[2].tobytes() == b[2].tobytes()
    assert engine.attacks.keys() == {1, 3}


def test_attacked_updates_reach_the_server() -> None:
    # Prepare: one FedAvg round, every client sign-flipped
    honest = _engine()
    p0 = honest.core.params.copy()
    flipped = _engine(attacks=dict.fromkeys(range(4), make_attack("sign-flip")))
    # Execute
    a, b = honest.run(), flipped.run()
    # Assert: the server stepped the other way
    np.testing.assert_allclose(b.params - p0, -(a.params - p0), atol=1e-6)
    assert b.summary["simulation"]["attackers"] == 4


def test_without_attacks_the_hooked_path_gives_the_same_run_bit_for_bit() -> None:
    plain = _engine(versions=3).run()
    hooked = _engine(versions=3, attacks={}, update_hook=lambda batch: None).run()
    assert plain.params.tobytes() == hooked.params.tobytes()
    assert plain.summary["bytes_up"] == hooked.summary["bytes_up"]


def test_in_sync_mode_with_equal_devices_every_round_is_one_batch() -> None:
    recorder = Recorder()
    _engine(versions=3, update_hook=recorder).run()
    assert [b.clients for b in recorder.batches] == [(0, 1, 2, 3)] * 3
    assert [set(b.versions) for b in recorder.batches] == [{0}, {1}, {2}]
    assert [set(b.rounds) for b in recorder.batches] == [{1}, {2}, {3}]
    assert all(not u.flags.writeable for b in recorder.batches for u in b.updates)


def test_the_hook_replaces_updates_across_clients() -> None:
    # Prepare: an ALIE-style hook: clients 2 and 3 send the mean of 0 and 1's updates
    seen: list[dict[int, np.ndarray]] = []

    def hook(batch: UpdateBatch) -> dict[int, np.ndarray]:
        ups = dict(zip(batch.clients, batch.updates, strict=True))
        mean = np.mean([ups[0], ups[1]], axis=0).astype(np.float32)
        seen.append(ups)
        return {2: mean, 3: mean}

    engine = _engine(update_hook=hook)
    p0 = engine.core.params.copy()
    # Execute
    result = engine.run()
    # Assert: FedAvg of (u0, u1, m, m) with the clients' example counts as weights
    ups = seen[0]
    n = [len(load_task(LOGREG).client_data(c, 4)) for c in range(4)]
    mean = np.mean([ups[0], ups[1]], axis=0)
    want = (n[0] * ups[0] + n[1] * ups[1] + (n[2] + n[3]) * mean) / sum(n)
    np.testing.assert_allclose(result.params - p0, want, atol=1e-6)


def test_bad_attacks_and_hook_results_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="client index 0..3"):
        _engine(attacks={4: make_attack("sign-flip")})
    with pytest.raises(TypeError, match="must be a murmura.client.malicious.Attack"):
        _engine(attacks={0: "sign-flip"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not in this batch"):
        _engine(update_hook=lambda b: {7: b.updates[0]}).run()
    with pytest.raises(ValueError, match="shape"):
        _engine(update_hook=lambda b: {b.clients[0]: b.updates[0][:5]}).run()
    with pytest.raises(ValueError, match="update attack gave client 2"):
        _engine(attacks={2: Attack(update=lambda u: np.zeros(3, np.float32))}).run()


def test_seeded_attacks_rerun_identically() -> None:
    def run() -> np.ndarray:
        noisy = {c: make_attack("noise", {"std": "2", "relative": "1"}, seed=c) for c in (1, 2)}
        return _engine("async", clients=6, versions=6, attacks=noisy).run().params

    assert run().tobytes() == run().tobytes()


# -- refusals: ClientRuntime's rules in virtual time ---------------------------------------


def test_a_refused_update_drops_the_work_and_the_client_asks_for_the_next_task() -> None:
    # Prepare: client 0 sends NaN, which the server refuses (INVALID_ARGUMENT)
    engine = _engine("async", clients=4, versions=8,
                     attacks={0: Attack(update=lambda u: np.full_like(u, np.nan))})
    # Execute
    result = engine.run()
    # Assert: refused every time, and it kept asking for work
    assert result.version == 8
    assert engine.refused["INVALID_ARGUMENT"] == engine.core.traffic.refused["INVALID_ARGUMENT"]
    assert engine.refused["INVALID_ARGUMENT"] >= 3
    assert engine.gave_up == 0


def test_a_lost_session_rejoins_and_sends_the_interrupted_request_again() -> None:
    # Prepare: the server forgets client 0's session while it trains
    engine = _engine("async", clients=3, versions=12)
    pushes: list[tuple[str, str, str]] = []  # (client, update id, outcome)
    core_precheck = engine.core.precheck

    def precheck(header):  # the engine's first call for every push
        try:
            record = core_precheck(header)
        except ServiceError as exc:
            pushes.append(("?", header.update_id, exc.status))
            raise
        pushes.append((record.client_id, header.update_id, "accepted"))
        return record

    engine.core.precheck = precheck  # type: ignore[method-assign]
    engine.advance(until_s=5.0)
    old = engine.sessions[0]
    flight = engine.flights[0]  # pulled, not yet pushed: its next request is the push
    assert old and flight.version >= 0 and flight.header is None
    engine.core.leave(old)
    # Execute
    engine.run()
    # Assert: the push of the interrupted task was refused, then sent again after a re-join
    assert engine.refused["UNAUTHENTICATED"] == 1
    refused = [uid for _, uid, outcome in pushes if outcome == "UNAUTHENTICATED"]
    assert len(refused) == 1
    assert (engine.ids[0], refused[0], "accepted") in pushes
    assert engine.gave_up == 0


def test_a_retryable_refusal_sends_the_same_push_after_the_backoff() -> None:
    # Prepare: the server is briefly unavailable for client 0's first push
    engine = _engine("async", clients=2, versions=4)
    pushes: list[tuple[float, str, str]] = []
    core_push = engine.core.pipeline.push
    failed: list[float] = []

    def push(header, payload, **kw):
        client = engine.core._record(header.session).client_id
        pushes.append((engine.clock.now, client, header.update_id))
        if client == engine.ids[0] and not failed:
            failed.append(engine.clock.now)
            raise Unavailable("restarting")
        return core_push(header, payload, **kw)

    engine.core.pipeline.push = push  # type: ignore[method-assign]
    # Execute
    engine.run()
    # Assert: the same update id again, one backoff later (RetryPolicy().initial_s, jittered)
    mine = [(t, uid) for t, cid, uid in pushes if cid == engine.ids[0]]
    assert mine[1][1] == mine[0][1]
    jitter = engine.retry.initial_s * engine.retry.jitter
    assert mine[1][0] - failed[0] == pytest.approx(engine.retry.initial_s, abs=jitter)
    assert engine.refused["UNAVAILABLE"] == 1 and engine.gave_up == 0
