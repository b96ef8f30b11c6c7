"""Restarts over the aggregator's state, on every backend (server/state.py): real SQLite and
spool files in a temporary directory, and the in-memory state. A crash is simulated by
abandoning the core and its state at a chosen step and opening them again, as a restarted
process would (the in-memory state keeps what was submitted; a killed process keeps what was
committed). Checks of what a restart finds go through the state interface."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import ServerConfig
from murmura.server.app import assemble_core
from murmura.server.checkpoint import load_checkpoint
from murmura.server.core import AggregatorCore
from murmura.server.state import MemoryState, StoredState
from murmura.server.store import SqliteState

SPEC = ModelSpec((TensorSpec("w", (2, 2)),))
P0 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
ASYNC = dict(mode="async", buffer_size=3, max_versions=50, optimizer="fedavgm", seed=1,
             require_identity=False)  # plain ids; see the identity test at the end


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Crash(Exception):
    """Stands for the process dying at a step of publishing."""


def open_core(out, clock=None, **cfg) -> AggregatorCore:
    return assemble_core(ServerConfig.from_flat(**{**ASYNC, **cfg}), SPEC, P0, out_dir=out,
                         clock=clock or Clock(), durable=True)


class Backend:
    """Opens cores over one kind of state; a second open of a directory is a restart."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.memory: dict[Path, MemoryState] = {}

    def open_core(self, out, clock=None, **cfg) -> AggregatorCore:
        if self.kind == "sqlite":
            return open_core(out, clock, **cfg)
        previous = self.memory.get(Path(out))
        state = previous.reopened() if previous is not None else MemoryState()
        self.memory[Path(out)] = state
        return assemble_core(ServerConfig.from_flat(**{**ASYNC, **cfg}), SPEC, P0, out_dir=out,
                             clock=clock or Clock(), durable=state)

    def stored(self, out) -> StoredState:
        """What a restart over ``out`` would load (the last core must be stopped)."""
        if self.kind == "memory":
            return self.memory[Path(out)].reopened().load()
        state = SqliteState(out)
        try:
            return state.load()
        finally:
            state.close()


@pytest.fixture(params=["sqlite", "memory"])
def backend(request) -> Backend:
    return Backend(request.param)


def kill(core: AggregatorCore) -> None:
    """Abandon the core as a killed process would: nothing more reaches the disk."""
    assert core.store is not None
    core.store.abandon()


def push(core, session, update, uid, *, base=None, n=10):
    payload = np.asarray(update, "<f4").tobytes()
    header = UpdateHeader(session=session, update_id=uid,
                          base_version=core.version if base is None else base, num_examples=n,
                          round=getattr(core.policy, "round", 0), codec="dense-f32",
                          payload_bytes=len(payload), spec_fingerprint=core.fingerprint)
    return core.push(header, payload, wire_bytes=len(payload) + 40)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_counted_ids_sessions_and_counters_survive_a_restart(backend, tmp_path) -> None:
    core = backend.open_core(tmp_path, clock=Clock(5.0))
    a = core.join("a", DeviceProfile(device="cpu", cpu_count=3)).session
    for i in range(4):  # one version (3 updates) and one update pending
        push(core, a, [1, 1, 1, 1], f"u{i}")
    core.add_download(1000)
    assert core.version == 1
    before = (core.traffic.updates, core.traffic.bytes_up)
    kill(core)

    again = backend.open_core(tmp_path, clock=Clock(100.0))
    # the session still works, the counters continue, and a retried push is a duplicate
    assert again.sessions[a].client_id == "a" and again.sessions[a].profile.cpu_count == 3
    assert (again.traffic.updates, again.traffic.bytes_up) == before
    assert again.version == 1 and again.policy.buffered() == 1
    dup = push(again, a, [9, 9, 9, 9], "u3")
    assert dup.duplicate and again.traffic.updates == 4
    # time_s continues from the last committed elapsed time (5 s here), not from 0
    push(again, a, [1, 1, 1, 1], "u4")
    push(again, a, [1, 1, 1, 1], "u5")
    assert again.version == 2
    row = rows(tmp_path)[-1]
    assert row["version"] == 2 and row["updates"] == 6
    assert row["bytes_up"] == before[1] + 3 * 56  # the duplicate crossed the wire too
    again.close()


def test_time_continues_across_restarts(backend, tmp_path) -> None:
    clock = Clock(10.0)
    core = backend.open_core(tmp_path, clock=clock, buffer_size=1)
    a = core.join("a", DeviceProfile()).session
    clock.t = 17.0
    push(core, a, [1, 1, 1, 1], "u0")
    assert rows(tmp_path)[-1]["time_s"] == pytest.approx(7.0)
    kill(core)
    clock2 = Clock(500.0)
    again = backend.open_core(tmp_path, clock=clock2, buffer_size=1)
    clock2.t = 503.0
    push(again, a, [1, 1, 1, 1], "u1")
    assert [r["time_s"] for r in rows(tmp_path)] == pytest.approx([7.0, 10.0])
    # the summary (and the plot, drawn from the same rows) covers the whole run
    assert [r["version"] for r in again.recorder.rows] == [1, 2]
    assert again.recorder.finish(plot=False)["time_s"] == pytest.approx(10.0)
    again.close()


def test_pending_updates_are_replayed_in_order_and_give_the_same_model(backend, tmp_path) -> None:
    updates = [np.array([i, -i, 2 * i, 0.5], np.float32) for i in range(1, 8)]
    # reference: no restart
    ref = backend.open_core(tmp_path / "ref")
    s = ref.join("a", DeviceProfile()).session
    for i, u in enumerate(updates):
        push(ref, s, u, f"u{i}", base=0 if i < 3 else None)
    # the same pushes with a crash after the fifth (version 1 published, two pending)
    core = backend.open_core(tmp_path / "crash")
    s = core.join("a", DeviceProfile()).session
    for i, u in enumerate(updates[:5]):
        push(core, s, u, f"u{i}", base=0 if i < 3 else None)
    assert core.version == 1 and core.policy.buffered() == 2
    kill(core)
    again = backend.open_core(tmp_path / "crash")
    assert again.version == 1 and again.policy.buffered() == 2  # the buffer is as it was
    for i, u in enumerate(updates[5:], start=5):
        push(again, s, u, f"u{i}")
    assert again.version == ref.version == 2
    np.testing.assert_array_equal(again.params, ref.params)
    assert [r["version"] for r in rows(tmp_path / "crash")] == [1, 2]
    ref.close()
    again.close()
    assert len(backend.stored(tmp_path / "crash").pending) == 1


def run_pushes(core, n, start=0):
    s = core.join("a", DeviceProfile()).session
    for i in range(start, start + n):
        push(core, s, [i, 1, -i, 2], f"u{i}")
    return s


@pytest.mark.parametrize("step", ["checkpoint_written", "committed", "recorded"])
def test_publish_is_atomic_whatever_step_the_crash_hits(backend, tmp_path, step) -> None:
    ref = backend.open_core(tmp_path / "ref")
    run_pushes(ref, 6)
    out = tmp_path / "crash"
    core = backend.open_core(out)
    s = run_pushes(core, 3)
    assert core.version == 1

    def crash(at: str) -> None:
        if at == step:
            raise Crash(at)
    core.crash_hook = crash
    for i in range(3, 6):  # the sixth update makes version 2, which "dies" at `step`
        push(core, s, [i, 1, -i, 2], f"u{i}")
    kill(core)
    found = backend.stored(out)
    committed, pending = max(r["version"] for r in found.rows), len(found.pending)
    if step == "checkpoint_written":  # not committed: the old version, its updates pending
        assert (committed, pending) == (1, 3)
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["v00000001.npz",
                                                                   "v00000002.npz"]
    else:  # committed: the new version, nothing pending
        assert (committed, pending) == (2, 0)

    again = backend.open_core(out)  # a replayed full buffer publishes version 2 again
    assert again.version == 2 and again.policy.buffered() == 0
    assert [r["version"] for r in rows(out)] == [1, 2]  # never twice, never missing
    assert load_checkpoint(out / "checkpoint.npz").version == 2
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["v00000002.npz"]
    np.testing.assert_array_equal(again.params, ref.params)
    assert again.traffic.updates == 6
    ref.close()
    again.close()
    assert backend.stored(out).pending == []


def test_refused_update_is_not_kept(backend, tmp_path) -> None:
    core = backend.open_core(tmp_path, max_staleness=0, buffer_size=1)
    s = core.join("a", DeviceProfile()).session
    push(core, s, [1, 1, 1, 1], "u0")
    with pytest.raises(Exception, match="versions old"):
        push(core, s, [1, 1, 1, 1], "u1", base=0)
    core.join("b", DeviceProfile())  # counters reach the disk with the next commit
    core.last_durable.result()
    kill(core)
    again = backend.open_core(tmp_path, max_staleness=0, buffer_size=1)
    assert again.traffic.updates == 1 and ("a", "u1") not in again._seen
    assert again.traffic.refused == {"FAILED_PRECONDITION": 1}
    assert not push(again, s, [1, 1, 1, 1], "u1").duplicate  # it may come again, once
    again.close()


def test_robust_rule_state_is_saved_with_the_checkpoint(backend, tmp_path) -> None:
    rng = np.random.default_rng(0)
    ups = rng.normal(size=(12, 4)).astype(np.float32)
    cfg = dict(defense="default", buffer_size=3)
    ref = backend.open_core(tmp_path / "ref", **cfg)
    ids = [ref.join(c, DeviceProfile()).session for c in "abc"]
    for i, u in enumerate(ups):
        push(ref, ids[i % 3], u, f"u{i}", base=ref.version)
    core = backend.open_core(tmp_path / "crash", **cfg)
    ids = [core.join(c, DeviceProfile()).session for c in "abc"]
    for i, u in enumerate(ups[:6]):
        push(core, ids[i % 3], u, f"u{i}", base=core.version)
    assert len(core.policy.aggregator.scorer) == 3
    kill(core)
    again = backend.open_core(tmp_path / "crash", **cfg)
    assert len(again.policy.aggregator.scorer) == 3  # the Sybil histories came back
    saved, restored = core.policy.aggregator.state_dict(), again.policy.aggregator.state_dict()
    assert saved.keys() == restored.keys()
    for name in saved:  # histories, last updates and the clock all came back
        np.testing.assert_array_equal(restored[name], saved[name])
    for i, u in enumerate(ups[6:], start=6):
        push(again, ids[i % 3], u, f"u{i}", base=again.version)
    np.testing.assert_array_equal(again.params, ref.params)
    ref.close()
    again.close()


def test_non_durable_resume_keeps_counters_and_the_whole_metrics_file(tmp_path) -> None:
    cfg = ServerConfig.from_flat(**{**ASYNC, "buffer_size": 1})
    core = assemble_core(cfg, SPEC, P0, out_dir=tmp_path, clock=Clock())
    s = core.join("a", DeviceProfile()).session
    for i in range(3):
        push(core, s, [1, 1, 1, 1], f"u{i}")
    core.recorder.finish(plot=False)
    resumed = assemble_core(cfg, SPEC, P0, out_dir=tmp_path, clock=Clock(),
                            resume=tmp_path / "checkpoint.npz")
    s = resumed.join("a", DeviceProfile()).session
    push(resumed, s, [1, 1, 1, 1], "u9")
    assert [r["version"] for r in rows(tmp_path)] == [1, 2, 3, 4]
    assert rows(tmp_path)[-1]["updates"] == 4


def test_sync_round_update_acknowledged_before_a_crash_enters_the_next_version(
        backend, tmp_path) -> None:
    cfg = dict(mode="sync", min_clients=2)
    core = backend.open_core(tmp_path, **cfg)
    a, b = (core.join(c, DeviceProfile()).session for c in "ab")
    assert core.task(a).round == 1
    push(core, a, [1, 1, 1, 1], "a1")  # acknowledged; b never answers before the crash
    kill(core)
    again = backend.open_core(tmp_path, **cfg)
    assert again.policy.buffered() == 1 and again.version == 0
    assert push(again, a, [5, 5, 5, 5], "a1").duplicate
    ta, tb = again.task(a), again.task(b)  # a new round: both are asked again
    assert ta.round == tb.round == 1
    push(again, a, [2, 2, 2, 2], "a2")
    push(again, b, [3, 3, 3, 3], "b1")
    assert again.version == 1
    row = rows(tmp_path)[-1]
    assert row["updates_in_version"] == 3 and row["updates"] == 3
    again.close()


def test_updates_of_a_dropped_aggregate_are_not_replayed(backend, tmp_path) -> None:
    # Each update is inside the fold bound, but the server step overflows float32: dropped.
    cfg = dict(buffer_size=2, optimizer="fedavg", server_lr=1e38)
    core = backend.open_core(tmp_path, **cfg)
    s = core.join("a", DeviceProfile()).session
    push(core, s, [1, 1, 1, 1], "u0")
    push(core, s, [10, 10, 10, 10], "u1")
    assert core.version == 0 and core.policy.buffered() == 0
    core.close()
    again = backend.open_core(tmp_path, **cfg)
    assert again.version == 0 and again.policy.buffered() == 0
    assert again.traffic.updates == 2 and push(again, s, [0, 0, 0, 0], "u1").duplicate
    again.close()


def test_a_second_server_on_the_same_directory_is_refused(tmp_path) -> None:
    core = open_core(tmp_path)
    with pytest.raises(ValueError, match="another murmura server is using"):
        open_core(tmp_path)
    core.close()
    open_core(tmp_path).close()  # free again once the first has stopped


def test_a_restored_session_keeps_its_proven_key_and_signed_pushes_go_on(backend, tmp_path) -> None:
    """Identities and durable state together: after a restart the session's Ed25519 key is
    back, so the client's signed pushes count and another key's signature is refused."""
    from murmura.protocols.identity import NodeKey, payload_digest
    from murmura.server import PermissionDenied

    key, other = NodeKey.from_seed(b"durable-a"), NodeKey.from_seed(b"durable-b")
    core = backend.open_core(tmp_path, require_identity=True)
    nonce, _ = core.challenge()
    session = core.join(key.client_id, DeviceProfile(), proof=key.join_proof(nonce)).session

    def signed(signer: NodeKey, core: AggregatorCore, uid: str) -> tuple[UpdateHeader, bytes]:
        payload = np.ones(4, "<f4").tobytes()
        header = UpdateHeader(session=session, update_id=uid, base_version=core.version,
                              num_examples=1, codec="dense-f32", payload_bytes=len(payload),
                              spec_fingerprint=core.fingerprint)
        return signer.sign_update(header, payload_digest(payload)), payload

    core.push(*signed(key, core, "s1"))
    kill(core)
    again = backend.open_core(tmp_path, require_identity=True)
    assert again.sessions[session].public_key == key.public_bytes
    with pytest.raises(PermissionDenied):
        again.push(*signed(other, again, "s2"))
    assert not again.push(*signed(key, again, "s2")).duplicate
    assert again.traffic.updates == 2


def test_compass_replays_held_updates_into_the_next_aggregate(backend, tmp_path) -> None:
    """A FedCompass update held for its group is acknowledged, so a restart must keep it: it
    comes back as a late update and enters the next version."""
    cfg = dict(mode="compass", compass_max_steps=10)
    core = backend.open_core(tmp_path, **cfg)
    a = core.join("a", DeviceProfile(steps_per_s=10.0)).session
    b = core.join("b", DeviceProfile(steps_per_s=10.0)).session
    core.task(a), core.task(b)            # one group of two
    push(core, a, [1, 1, 1, 1], "a1")     # held until b arrives
    assert core.version == 0 and core.policy.buffered() == 1
    kill(core)
    again = backend.open_core(tmp_path, **cfg)
    assert again.version == 0 and again.policy.buffered() == 1
    push(again, b, [3, 3, 3, 3], "b1")    # its group is gone with the old process
    assert again.version == 1 and again.last_metrics["updates_in_version"] == 2
    again.close()
