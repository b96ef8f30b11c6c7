"""FedCompass through the simulator: the same core (``build_core``), per-task local steps."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import Simulation, SimulationConfig, simulate
from murmura.simulation.devices import DevicePopulation
from murmura.tasks import TaskConfig

LOGREG = TaskConfig(task="digits", model="logreg", partition="iid")


def _compass(**kw) -> ServerConfig:
    return ServerConfig.from_flat(mode="compass", compass_max_steps=10, seed=0,
                                  train=TaskSettings(local_steps=10, batch_size=16), **kw)


@pytest.mark.slow
def test_compass_gives_fast_devices_more_steps_and_keeps_staleness_low() -> None:
    sim = Simulation(LOGREG, _compass(max_versions=8),
                     SimulationConfig(clients=12, step_time_s=0.05, speed_spread=10.0),
                     out_dir=None)
    assigned: dict[int, list[int]] = {}
    serve = sim._serve_task

    def spy(c: int) -> None:  # record each TRAIN answer's local steps
        serve(c)
        flight = sim.flights.get(c)
        if flight is not None and flight.version < 0:
            assigned.setdefault(c, []).append(flight.steps)
    sim._serve_task = spy  # type: ignore[method-assign]

    result = sim.run()

    assert result.version == 8 and result.final_accuracy > 0.5
    steps = {c: float(np.mean(v)) for c, v in assigned.items()}
    assert all(2 <= s <= 10 for v in assigned.values() for s in v)
    order = np.argsort(sim.devices.step_time_s)
    fastest, slowest = order[:3], order[-3:]
    assert min(steps[c] for c in fastest) > max(steps[c] for c in slowest)
    stale = result.staleness  # groups: several updates per version, most of them fresh
    updates = sum(stale.values())
    assert updates >= 3 * result.version
    assert sum(k * v for k, v in stale.items()) / updates <= 1.0


def test_compass_simulation_reruns_identically() -> None:
    sim = SimulationConfig(clients=8, step_time_s=0.05, speed_spread=10.0, stragglers=0.25)
    a = simulate(LOGREG, _compass(max_versions=6), sim, out_dir=None)
    b = simulate(LOGREG, _compass(max_versions=6), sim, out_dir=None)
    assert np.array_equal(a.params, b.params) and a.virtual_s == b.virtual_s


def test_stragglers_are_a_seeded_fraction_slowed_by_their_factor() -> None:
    kw = dict(seed=3, step_time_s=0.1, speed_spread=10.0, uplink_mbps=20.0,
              downlink_mbps=100.0, latency_ms=20.0)
    plain = DevicePopulation.sample(50, **kw)
    slow = DevicePopulation.sample(50, stragglers=0.1, straggler_factor=100.0, **kw)
    ratio = slow.step_time_s / plain.step_time_s
    assert np.count_nonzero(np.isclose(ratio, 100.0)) == 5
    assert np.count_nonzero(np.isclose(ratio, 1.0)) == 45
