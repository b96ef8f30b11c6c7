"""The Python entry point: ``simulate(task, server, simulation)``, as ``murmura simulate``
runs it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from murmura.server import ServerConfig
from murmura.simulation.config import SimulationConfig
from murmura.simulation.data import SimulationData
from murmura.simulation.engine import Simulation, SimulationResult
from murmura.simulation.execution import Executor, check_own_trainer_path
from murmura.tasks import TaskConfig


def prepare_server(server: ServerConfig, sim: SimulationConfig, *,
                   wait_for_all_clients: bool = True) -> ServerConfig:
    """Apply ``murmura run``'s rules to a server config.

    One seed for the run (the clients' training seed is the server's ``seed``), and, when
    ``wait_for_all_clients`` and every client is always online, the first round waits for all
    of them (``min_clients = clients``) so the first cohort is deterministic.
    """
    if server.train.trainer == "zo":  # refused before anything is built
        check_own_trainer_path("the zeroth-order trainer", sim.executor, sim.vectorise,
                               vectorised=True)
    if server.train.seed != server.seed:
        server = dataclasses.replace(server, train=dataclasses.replace(server.train,
                                                                       seed=server.seed))
    if wait_for_all_clients and sim.availability == "always" and \
            (not server.policy.cohort_size or server.policy.cohort_size >= sim.clients):
        server = server.replace(min_clients=sim.clients)
    return server


def simulate(task: TaskConfig | None = None, server: ServerConfig | None = None,
             simulation: SimulationConfig | None = None, *, data: SimulationData | None = None,
             executor: Executor | None = None, out_dir: str | Path | None | bool = True,
             evaluate: bool = True, wait_for_all_clients: bool = True,
             progress: Callable[[dict[str, Any]], None] | None = None) -> SimulationResult:
    """Simulate a federation: the same task and server configs as ``murmura run``.

    Writes ``metrics.jsonl``, ``summary.json`` and the plots to ``simulation.out`` (or
    ``out_dir``; ``None`` writes nothing) and returns the result, final model included.
    """
    task = task or TaskConfig()
    sim = simulation or SimulationConfig()
    server = prepare_server(server or ServerConfig(), sim,
                            wait_for_all_clients=wait_for_all_clients)
    engine = Simulation(task, server, sim, data=data, executor=executor, out_dir=out_dir,
                        evaluate=evaluate, progress=progress)
    return engine.run()


__all__ = ["prepare_server", "simulate"]
