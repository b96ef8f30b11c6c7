"""Telemetry: the snapshot contract, a bounded per-client table, counts that agree with the
core's own counters, and reads from another thread through the core's owner."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import AggregatorCore, InvalidArgument, RunRecorder, ServerConfig
from murmura.server.telemetry import MAX_CLIENTS, Telemetry

SPEC = ModelSpec((TensorSpec("w", (4,)),))

#: The snapshot contract the web dashboard builds on (server/telemetry.py).
TOP_KEYS = {"role", "run", "version", "done", "clients_active", "updates_total",
            "refused_total", "versions_total", "bytes_in_total", "bytes_out_total",
            "staleness_hist", "metrics", "clients", "tier", "peers"}
RUN_KEYS = {"name", "dir", "mode", "rule", "started_unix"}
CLIENT_KEYS = {"client_id", "device", "steps_per_s", "last_seen_s_ago", "updates",
               "last_staleness", "weight", "refusals", "active"}
TIER_KEYS = {"workers", "queue_depth", "cold_starts"}


def make_core(out: Path | None = None, **cfg: object) -> AggregatorCore:
    flat: dict[str, object] = {"mode": "async", "buffer_size": 2, "min_clients": 1,
                               "max_versions": 50, "require_identity": False, "push_per_s": 0.0,
                               "join_per_s": 0.0}
    flat.update(cfg)
    recorder = RunRecorder(out) if out is not None else None
    return AggregatorCore(ServerConfig.from_flat(**flat), SPEC, np.zeros(4, np.float32),
                          recorder=recorder,
                          evaluator=lambda p: {"accuracy": float(np.tanh(abs(p).sum())),
                                               "loss": float(abs(p).mean())})


def push(core: AggregatorCore, session: str, values: list[float], *, base: int | None = None
         ) -> None:
    payload = np.asarray(values, "<f4").tobytes()
    header = UpdateHeader(session=session, update_id=uuid.uuid4().hex,
                          base_version=core.version if base is None else base, round=0,
                          num_examples=3, codec="dense-f32", payload_bytes=len(payload),
                          spec_fingerprint=core.fingerprint)
    core.push(header, payload, wire_bytes=len(payload) + 40)


def test_the_snapshot_has_exactly_the_contract_keys_and_is_json(tmp_path: Path) -> None:
    core = make_core(tmp_path / "run-a")
    session = core.join("a", DeviceProfile(device="cuda", device_name="RTX 4090",
                                           steps_per_s=12.5)).session
    for _ in range(2):
        push(core, session, [0.1, 0.1, 0.1, 0.1])

    snap = json.loads(json.dumps(core.telemetry.snapshot()))  # JSON-ready as it is

    assert set(snap) == TOP_KEYS
    assert set(snap["run"]) == RUN_KEYS and set(snap["tier"]) == TIER_KEYS
    assert [set(c) for c in snap["clients"]] == [CLIENT_KEYS]
    assert snap["role"] == "server" and snap["peers"] == []
    assert snap["run"] == {**snap["run"], "name": "run-a", "dir": str(tmp_path / "run-a"),
                           "mode": "async", "rule": "fedavg"}
    assert (snap["version"], snap["versions_total"], snap["updates_total"]) == (1, 1, 2)
    assert snap["metrics"]["version"] == 1 and "accuracy" in snap["metrics"]
    assert snap["bytes_in_total"] == {"dense-f32": 2 * (16 + 40)}
    assert snap["staleness_hist"] == {"0": 2}
    client = snap["clients"][0]
    assert client == {**client, "client_id": "a", "device": "cuda: RTX 4090",
                      "steps_per_s": 12.5, "updates": 2, "last_staleness": 0, "weight": None,
                      "refusals": 0, "active": True}


def test_counts_agree_with_the_core_and_refusals_land_on_their_client() -> None:
    core = make_core(max_staleness=3)
    a = core.join("a", DeviceProfile()).session
    b = core.join("b", DeviceProfile()).session
    push(core, a, [1, 1, 1, 1])
    push(core, b, [1, 1, 1, 1])   # version 1
    push(core, a, [1, 1, 1, 1], base=0)  # one version old
    with pytest.raises(InvalidArgument):
        push(core, b, [1.0, 1.0, 1.0])  # wrong size: refused when decoded
    core.leave(a)

    snap = core.telemetry.snapshot()

    assert snap["updates_total"] == core.traffic.updates == 3
    assert snap["refused_total"] == core.traffic.refused_by_reason == {
        "INVALID_ARGUMENT: payload does not decode": 1}
    assert snap["staleness_hist"] == {"0": 2, "1": 1}
    assert sum(snap["bytes_in_total"].values()) == core.traffic.bytes_up
    by_id = {c["client_id"]: c for c in snap["clients"]}
    assert (by_id["a"]["refusals"], by_id["b"]["refusals"]) == (0, 1)
    assert (by_id["a"]["active"], by_id["b"]["active"]) == (False, True)
    assert by_id["a"]["last_staleness"] == 1
    assert snap["clients_active"] == 1
    assert [c["client_id"] for c in snap["clients"]] == ["b", "a"]  # most recent first


def test_the_per_client_table_is_bounded_and_forgets_the_least_recent() -> None:
    assert MAX_CLIENTS == 100_000
    core = make_core()
    core.telemetry = Telemetry(core, max_clients=5)
    sessions = {}
    for i in range(12):
        sessions[i] = core.join(f"c{i:02d}", DeviceProfile()).session
    push(core, sessions[0], [0.5, 0, 0, 0])  # c00 comes back: it is remembered again

    table = core.telemetry.clients
    assert len(table) == 5
    assert list(table) == ["c08", "c09", "c10", "c11", "c00"]
    assert table["c00"].updates == 1
    assert len(core.telemetry.snapshot(max_clients=2)["clients"]) == 2
    assert core.telemetry.snapshot(max_clients=0)["clients"] == []


def test_a_hostile_codec_name_is_not_a_label() -> None:
    core = make_core()
    session = core.join("a", DeviceProfile()).session
    payload = np.ones(4, "<f4").tobytes()
    for name in ("x" * 60, "../../etc", "dense-f32"):
        header = UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=0,
                              round=0, num_examples=1, codec=name, payload_bytes=16,
                              spec_fingerprint=core.fingerprint)
        try:
            core.push(header, payload, wire_bytes=16)
        except InvalidArgument:
            pass

    assert core.telemetry.bytes_in == {"other": 32, "dense-f32": 16}


def test_a_sybil_weighting_rule_gives_each_client_its_weight() -> None:
    core = make_core(buffer_size=3, defense="sybil")
    sessions = [core.join(f"c{i}", DeviceProfile()).session for i in range(3)]
    push(core, sessions[0], [1.0, 0.0, 0.0, 0.0])
    push(core, sessions[1], [1.0, 0.0, 0.0, 0.0])   # a clone of c0's direction
    push(core, sessions[2], [0.0, 0.0, -1.0, 0.5])

    weights = {c["client_id"]: c["weight"] for c in core.telemetry.snapshot()["clients"]}

    assert core.version == 1
    assert all(isinstance(w, float) and 0.0 <= w <= 1.0 for w in weights.values()), weights
    assert weights["c2"] > weights["c0"]  # the clones weigh less than the honest update


def test_fedavg_exposes_no_per_update_weight() -> None:
    core = make_core()
    session = core.join("a", DeviceProfile()).session
    push(core, session, [1, 1, 1, 1])
    push(core, session, [1, 1, 1, 1])
    assert core.version == 1
    assert core.telemetry.snapshot()["clients"][0]["weight"] is None


def test_read_runs_on_the_owners_thread_and_times_out_when_it_is_busy() -> None:
    core = make_core()
    owner_calls: list[object] = []
    core.post = owner_calls.append  # an owner that has not run its queue yet
    reader: dict[str, object] = {}

    def read() -> None:
        try:
            core.telemetry.read(core.telemetry.snapshot, timeout_s=0.2)
        except TimeoutError as exc:
            reader["error"] = exc

    t = threading.Thread(target=read)
    t.start()
    t.join(5)

    assert isinstance(reader.get("error"), TimeoutError)
    assert len(owner_calls) == 1  # queued on the owner, and dropped once the reader gave up
    owner_calls[0]()  # type: ignore[operator]


def test_read_from_another_thread_goes_through_the_owner(serve_tiny) -> None:
    srv = serve_tiny(require_identity=False, workers=0)
    core = srv.core
    seen: list[str] = []

    def on_owner() -> dict[str, object]:
        seen.append(threading.current_thread().name)
        return core.telemetry.snapshot()

    snap = core.telemetry.read(on_owner)

    assert seen == ["murmura-aggregator"] and set(snap) == TOP_KEYS
