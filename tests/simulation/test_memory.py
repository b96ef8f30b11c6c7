"""Scale: ten thousand idle clients cost kilobytes each, never a model copy."""

from __future__ import annotations

import gc
import tracemalloc

from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import Simulation, SimulationConfig, load_simulation_data
from murmura.tasks import TaskConfig

LIMIT = 100 * 1024  # bytes per idle client (the bound)


def _warm_up() -> None:
    """Import what the first run imports lazily (torch.func, the evaluator...) beforehand,
    so the measurement sees the simulation's memory, not the interpreter's modules."""
    sim = SimulationConfig(clients=4, samples_per_client=5)
    task = TaskConfig(task="synthetic", model="mlp", partition="iid")
    Simulation(task, ServerConfig.from_flat(max_versions=1), sim, out_dir=None).run()


def _per_client(build_and_run, n: int) -> float:
    _warm_up()
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        keep = build_and_run()  # noqa: F841  (kept alive while measuring)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (after - before) / n


def test_ten_thousand_joined_idle_clients_fit_in_100_kb_each() -> None:
    # Prepare: the shared training data exists before the measurement starts
    n = 10_000
    task = TaskConfig(task="synthetic", model="mlp", partition="iid")
    sim = SimulationConfig(clients=n, samples_per_client=5, vectorise="off", workers=1)
    data = load_simulation_data(task, sim)
    # min_clients above n: every client joins, asks for a task and waits (a held long poll)
    server = ServerConfig.from_flat(min_clients=n + 1, max_versions=1)

    def build() -> Simulation:
        engine = Simulation(task, server, sim, data=data, out_dir=None, evaluate=False)
        engine.advance(until_s=60.0)
        assert len(engine.core.sessions) == n and len(engine.waiting) == n
        return engine

    # Execute
    per_client = _per_client(build, n)
    # Assert: far below the bound, and far below one model copy (4,810 floats = 19 KB)
    print(f"{per_client:.0f} bytes per idle client")
    assert per_client <= LIMIT
    assert per_client < 19_240 / 4


def test_clients_hold_no_model_after_training() -> None:
    n = 2_000
    task = TaskConfig(task="synthetic", model="mlp", partition="iid")
    sim = SimulationConfig(clients=n, samples_per_client=5)
    data = load_simulation_data(task, sim)
    server = ServerConfig.from_flat(min_clients=n, max_versions=2,
                                    train=TaskSettings(local_epochs=1, batch_size=5))

    def build() -> Simulation:
        engine = Simulation(task, server, sim, data=data, out_dir=None, evaluate=False)
        engine.run()
        assert engine.core.traffic.updates == 2 * n and not engine.flights
        return engine

    per_client = _per_client(build, n)
    print(f"{per_client:.0f} bytes per client after two rounds")
    assert per_client < 19_240 / 2  # less than half a model copy, all state included
