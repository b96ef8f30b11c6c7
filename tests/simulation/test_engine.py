"""The discrete-event engine: virtual time, device speeds, availability, staleness, outputs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from murmura.protocols import TaskSettings, available_codecs
from murmura.server import ServerConfig
from murmura.simulation import (
    ModelWire,
    Simulation,
    SimulationConfig,
    SimulationData,
    prepare_server,
    simulate,
)
from murmura.tasks import Task, TaskConfig

LOGREG = TaskConfig(task="digits", model="logreg", partition="iid")


def _server(**kw) -> ServerConfig:
    kw.setdefault("train", TaskSettings(local_epochs=1, batch_size=32))
    return ServerConfig.from_flat(**kw)


def test_a_sync_run_writes_its_outputs_in_virtual_time_and_reruns_identically(
        tmp_path: Path) -> None:
    # Prepare
    sim = SimulationConfig(clients=8, out=str(tmp_path / "a"), step_time_s=0.5)
    server = _server(max_versions=4)
    # Execute
    a = simulate(LOGREG, server, sim)
    b = simulate(LOGREG, server, SimulationConfig(clients=8, out=str(tmp_path / "b"),
                                                  step_time_s=0.5))
    # Assert
    assert np.array_equal(a.params, b.params)
    for name in ("metrics.jsonl", "summary.json", "accuracy.png"):
        assert (tmp_path / "a" / name).exists()
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert [r["time_s"] for r in rows] == [r["time_s"] for r in b.rows]
    assert rows[-1]["time_s"] == pytest.approx(a.virtual_s)
    assert rows[-1]["time_s"] > 4 * 0.5 * 36 / 32  # at least 4 rounds of 2 steps at 0.5 s
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["simulation"]["execution_path"] == "vmap"
    assert summary["config"]["simulation"]["clients"] == 8
    assert summary["final_accuracy"] > 0.5


def test_a_sync_round_lasts_as_long_as_its_slowest_device(tmp_path: Path) -> None:
    # Prepare: client 0 takes 1 s per step, the others 0.1 s; every link the same
    trace = tmp_path / "devices.csv"
    trace.write_text("step_time_s\n1.0\n0.1\n0.1\n0.1\n")
    sim = SimulationConfig(clients=4, device_trace=str(trace), latency_ms=50.0,
                           uplink_mbps=8.0, downlink_mbps=16.0)
    settings = TaskSettings(local_steps=5, batch_size=16)
    server = prepare_server(ServerConfig.from_flat(max_versions=1, train=settings), sim)
    engine = Simulation(LOGREG, server, sim, out_dir=None)
    # Execute
    result = engine.run()
    # Assert: join (1 latency), task (2), pull (2), download, 5 steps, upload (1 latency + bytes)
    lat, model_bytes = 0.05, ModelWire(engine.spec)(0)
    upload = engine.core.traffic.bytes_up / 4
    expected = 6 * lat + model_bytes / 2e6 + 5 * 1.0 + lat + upload / 1e6
    assert result.rows[0]["time_s"] == pytest.approx(expected, abs=1e-6)


def test_async_staleness_comes_from_the_event_order(tmp_path: Path) -> None:
    # Prepare: one device 10x slower than the other; every update makes a version
    trace = tmp_path / "devices.csv"
    trace.write_text("step_time_s\n0.1\n1.0\n")
    sim = SimulationConfig(clients=2, device_trace=str(trace), latency_ms=0.0,
                           out=str(tmp_path / "out"))
    server = _server(mode="async", buffer_size=1, max_versions=60, max_staleness=50,
                     train=TaskSettings(local_steps=4, batch_size=16))
    # Execute
    result = simulate(LOGREG, server, sim)
    # Assert: the fast client finishes ~10 updates while the slow one trains once
    assert max(result.staleness) in (9, 10, 11)
    assert result.staleness.get(0, 0) + result.staleness.get(1, 0) >= 40
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["simulation"]["staleness_histogram"] == {
        str(k): v for k, v in sorted(result.staleness.items())}
    assert (tmp_path / "out" / "staleness.png").exists()


def test_an_hour_of_federation_takes_seconds() -> None:
    sim = SimulationConfig(clients=50, step_time_s=20.0, speed_spread=10.0)
    t0 = time.perf_counter()
    result = simulate(LOGREG, _server(max_versions=20, round_deadline_s=10_000), sim,
                      out_dir=None)
    assert result.virtual_s > 3600
    assert time.perf_counter() - t0 < 30


def test_clients_that_drop_out_silently_hold_rounds_until_the_deadline() -> None:
    # Prepare: online ~60 s at a time, training takes 6-60 s: many drop out mid-training
    sim = SimulationConfig(clients=20, availability="churn", mean_online_s=60.0,
                           mean_offline_s=30.0, step_time_s=3.0, speed_spread=10.0)
    server = _server(max_versions=6, round_deadline_s=100.0, min_clients=2)
    # Execute
    silent = Simulation(LOGREG, prepare_server(server, sim), sim, out_dir=None)
    result = silent.run()
    leave = SimulationConfig(**{**sim.__dict__, "dropout": "leave"})
    polite = Simulation(LOGREG, prepare_server(server, leave), leave, out_dir=None).run()
    # Assert
    assert silent.lost > 0
    gaps = np.diff([0.0] + [r["time_s"] for r in result.rows])
    assert np.isclose(gaps, 100.0, atol=1.0).any()  # a round that waited for the deadline
    assert polite.virtual_s < result.virtual_s  # leaving tells the server; rounds close sooner


def test_max_time_stops_the_run_at_that_virtual_time() -> None:
    sim = SimulationConfig(clients=5, step_time_s=0.2, max_time_s=100.0)
    engine = Simulation(LOGREG, _server(max_versions=1000), sim, out_dir=None)
    result = engine.run()
    assert result.virtual_s == pytest.approx(100.0)
    assert result.rows[-1]["time_s"] <= 100.0
    assert 0 < result.version < 1000 and not result.summary["simulation"]["done"]


@pytest.mark.skipif("topk" not in available_codecs(), reason="topk codec not registered")
def test_a_codec_with_state_gets_one_encoder_per_client_that_trained() -> None:
    sim = SimulationConfig(clients=6)
    dense = simulate(LOGREG, _server(max_versions=2), sim, out_dir=None)
    topk = _server(max_versions=2, train=TaskSettings(local_epochs=1, batch_size=32,
                                                      codec="topk",
                                                      codec_options={"ratio": "0.05"}))
    engine = Simulation(LOGREG, prepare_server(topk, sim), sim, out_dir=None)
    result = engine.run()
    assert len(engine._encoders) == 6
    assert result.summary["bytes_up"] < dense.summary["bytes_up"] / 5


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) > 0 else -self.a(x)


@pytest.mark.parametrize("workers,path", [(1, "loop"), (2, "pool")])
def test_models_vmap_cannot_run_fall_back_and_say_so(digits: Task, workers: int,
                                                     path: str) -> None:
    task = Task(LOGREG, digits.train, digits.test, _DataDependent)
    data = SimulationData(task, list(digits.shares(4)), "digits")
    sim = SimulationConfig(clients=4, workers=workers)
    result = simulate(LOGREG, _server(max_versions=2), sim, data=data, out_dir=None)
    assert result.execution_path == path
    assert "vmap unavailable" in result.summary["simulation"]["probe"]
    assert result.version == 2
    with pytest.raises(ValueError, match="can't be vectorised"):
        Simulation(LOGREG, _server(), SimulationConfig(clients=4, vectorise="on"), data=data,
                   out_dir=None)


def test_an_update_is_made_in_the_trained_vectors_memory_only_where_that_is_safe() -> None:
    from murmura.simulation.updates import _delta

    base = np.arange(6, dtype=np.float32)
    trained = base + 0.5
    want = trained - base
    # a writable float32 result: the update replaces it in place (no new array)
    got = _delta(trained, base)
    assert np.shares_memory(got, trained) and np.array_equal(got, want)
    # a read-only one (a Ray object), or one that overlaps the base: a new array
    frozen = base + 0.5
    frozen.flags.writeable = False
    assert not np.shares_memory(_delta(frozen, base), frozen)
    block = np.stack([base, base + 0.5])
    assert np.array_equal(_delta(block[1], block[1]), np.zeros(6, np.float32))


def test_an_empty_out_writes_nothing_not_into_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from murmura.simulation import simulate

    monkeypatch.chdir(tmp_path)
    sim = SimulationConfig(clients=4, out="")
    result = simulate(LOGREG, _server(max_versions=1), sim)
    assert result.version == 1
    assert list(tmp_path.iterdir()) == []
    # out_dir given explicitly still wins over sim.out
    simulate(LOGREG, _server(max_versions=1), sim, out_dir=tmp_path / "here")
    assert (tmp_path / "here" / "summary.json").exists()
