"""``murmura simulate --flower-app``: a Flower app's clients as virtual clients.

Each virtual client ``i`` runs the app exactly as ``murmura client --flower-app`` does (the
same :func:`~murmura.client.flower_load.load_flower_client` trainer, partition ``i`` of N, the
app's run config), in this process one job after another (the loop executor) or in forked
worker processes (the pool). The aggregator is the one ``murmura server --flower-app`` runs
(:func:`~murmura.server.flower.flower_core`'s settings, evaluation and training-metric
rows), on the virtual clock.

The app's data lives inside the app, so the simulator holds none: each virtual client counts
as one example for the virtual compute time (``local_epochs`` steps per task). Virtual time
is therefore not calibrated for a Flower app; versions, accuracy and metrics are real.

As on ``murmura client``: the app's ServerApp settings map to the server's
(``fraction-train`` is the sync cohort fraction, client/flower_app.py); with
``client_eval_every`` each virtual client runs the app's evaluate handler on the global model
before it trains (its ``eval_*`` figures give ``client_<metric>_mean/min/max``); and each
client's properties (its query handler, asked when the client is created, at its first
task) are in summary.json as ``simulation.flower_properties``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from torch import nn

from murmura.protocols import TaskSettings
from murmura.server import AggregatorCore, ServerConfig
from murmura.simulation.config import SimulationConfig
from murmura.simulation.data import SimulationData
from murmura.simulation.engine import Simulation, client_id
from murmura.simulation.execution import Executor, Job, JobResult, default_workers
from murmura.tasks import ArrayDataset, TaskConfig
from murmura.tasks.registry import Task

log = logging.getLogger(__name__)


class FlowerLoopExecutor(Executor):
    """Each job runs client ``job.client``'s Flower trainer (loaded once per client)."""

    path = "loop"

    def __init__(self, ref: str, num_clients: int, run_config: str | None = None,
                 seed: int = 0) -> None:
        self.ref, self.num_clients, self.run_config, self.seed = ref, num_clients, run_config, seed
        self._trainers: dict[int, Any] = {}
        #: Each client's properties (its app's query handler), asked when it is created.
        self.properties: dict[int, dict[str, Any]] = {}
        #: Properties asked since :meth:`take_fresh` (what a worker sends back).
        self._fresh: dict[int, dict[str, Any]] = {}

    def trainer(self, client: int) -> Any:
        from murmura.client.flower_load import load_flower_client, query_properties

        if client not in self._trainers:
            trainer = self._trainers[client] = load_flower_client(
                self.ref, client_index=client, num_clients=self.num_clients,
                run_config_overrides=self.run_config, seed=self.seed)
            props = query_properties(trainer, client_id(client))
            if props:
                self.properties[client] = self._fresh[client] = props
        return self._trainers[client]

    def take_fresh(self) -> dict[int, dict[str, Any]]:
        """The properties of the clients created since the last call."""
        fresh, self._fresh = self._fresh, {}
        return fresh

    def run_one(self, job: Job, settings: TaskSettings, version: int) -> JobResult:
        trainer = self.trainer(job.client)
        trainer.on_pull(version)
        result = trainer.train(job.params, settings, seed=job.seed)
        assert result.params is not None
        return JobResult(result.params, result.num_examples, dict(result.metrics))

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        return [self.run_one(job, settings, self.version) for job in jobs]

    #: The global version the engine's current jobs train from (set before each batch).
    version = 0

    def describe(self) -> str:
        return "loop (each virtual client runs the Flower app, one at a time)"


_WORKER: FlowerLoopExecutor | None = None


def _init_worker(ref: str, num_clients: int, run_config: str | None, seed: int) -> None:
    import torch

    global _WORKER
    torch.set_num_threads(1)
    _WORKER = FlowerLoopExecutor(ref, num_clients, run_config, seed)


def _run_in_worker(jobs: list[Job], settings: TaskSettings, version: int
                   ) -> tuple[list[JobResult], dict[int, dict[str, Any]]]:
    assert _WORKER is not None, "worker was not initialised"
    results = [_WORKER.run_one(job, settings, version) for job in jobs]
    return results, _WORKER.take_fresh()


class FlowerPoolExecutor(FlowerLoopExecutor):
    """The loop over forked worker processes; a client always runs in the same worker, so
    the app's per-client state (its ``Context.state``, loaded data) stays with it."""

    path = "pool"

    def __init__(self, ref: str, num_clients: int, run_config: str | None = None,
                 seed: int = 0, *, workers: int = 2) -> None:
        super().__init__(ref, num_clients, run_config, seed)
        import multiprocessing as mp

        if workers < 2:
            raise ValueError(f"a process pool needs at least 2 workers, got {workers}")
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        self.workers = workers
        self._pools = [ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                           initargs=(ref, num_clients, run_config, seed))
                       for _ in range(workers)]

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        by_worker: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            by_worker.setdefault(job.client % self.workers, []).append(i)
        futures = {w: self._pools[w].submit(_run_in_worker, [jobs[i] for i in idx], settings,
                                            self.version) for w, idx in by_worker.items()}
        out: list[JobResult | None] = [None] * len(jobs)
        for w, idx in by_worker.items():
            results, fresh = futures[w].result()
            self.properties.update(fresh)
            for i, result in zip(idx, results, strict=True):
                out[i] = result
        return [r for r in out if r is not None]

    def describe(self) -> str:
        return f"pool ({self.workers} worker processes running the Flower app)"

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True, cancel_futures=True)


def _placeholder(task: TaskConfig, n: int) -> SimulationData:
    """Data for the engine's bookkeeping only: one row per client (the app has its own)."""
    rows = ArrayDataset(np.zeros((n, 1), np.float32), np.zeros(n, np.int64))
    return SimulationData(Task(task, rows, rows, nn.Identity), [np.array([i]) for i in range(n)],
                          source="the Flower app's own data")


class FlowerSimulation(Simulation):
    """:class:`Simulation` with a Flower app's aggregator and clients (module docstring)."""

    def __init__(self, ref: str, server: ServerConfig, sim: SimulationConfig, *,
                 run_config: str | None = None, given: Sequence[str] = (),
                 **kwargs: Any) -> None:
        from murmura.client.flower_app import server_app_settings
        from murmura.server.flower import flower_config

        if sim.executor not in ("auto", "loop", "pool") or sim.vectorise == "on":
            raise ValueError(f"a Flower app runs in the loop or pool executor "
                             f"(executor={sim.executor!r}, vectorise={sim.vectorise!r} asked)")
        self.ref, self.run_config = ref, run_config
        server, self._app_trainer = flower_config(server, ref, run_config=run_config,
                                                  given=given)
        # the ServerApp's strategy settings (fraction-train...): mapped, or a notice
        mapped = server_app_settings(self._app_trainer.run_config, mode=server.mode,
                                     given=given)
        if mapped.settings:
            server = server.replace(**mapped.settings)
        if mapped.notice:
            log.log(logging.WARNING if "ignored" in mapped.notice else logging.INFO, "%s",
                    mapped.notice)
        workers = sim.workers or default_workers()
        pool = sim.executor == "pool" or (sim.executor == "auto" and workers > 1
                                          and sim.clients > 1)
        executor: FlowerLoopExecutor = (
            FlowerPoolExecutor(ref, sim.clients, run_config, server.seed,
                               workers=min(max(workers, 2), sim.clients) if sim.clients > 1
                               else 2)
            if pool else FlowerLoopExecutor(ref, sim.clients, run_config, server.seed))
        self._flower_executor = executor
        super().__init__(TaskConfig(), server, sim, data=_placeholder(TaskConfig(), sim.clients),
                         executor=executor, **kwargs)
        self.probe_note = "a Flower app: each virtual client runs it"

    def _build_core(self, evaluate: bool) -> AggregatorCore:
        from murmura.server.app import assemble_core
        from murmura.server.client_train import ClientTrainMetrics
        from murmura.server.flower import trainer_run_config

        trainer = self._app_trainer
        config = self.server_config.replace(require_identity=False, allowed_keys="")
        core = assemble_core(
            config, trainer.spec, trainer.initial(), out_dir=self.out_dir,
            evaluator=trainer.evaluator() if evaluate else None, clock=self.clock,
            checkpoint=self.sim.checkpoint, fresh_metrics=True,
            run_config={"server": config.table(), "flower_app": self.ref,
                        "flower_run_config": trainer_run_config(trainer),
                        "simulation": dataclasses.asdict(self.sim),
                        "data": "the Flower app's own data"})
        core.client_train = ClientTrainMetrics()
        return core

    def _train_pending(self) -> None:
        self._flower_executor.version = self.core.version
        super()._train_pending()

    def _client_eval(self, clients: list[int]) -> dict[int, dict[str, float]]:
        """Nothing here: with ``client_eval_every`` each virtual client's trainer runs the
        app's evaluate handler on the global model itself (as ``murmura client`` does) and
        its ``eval_*`` figures ride on the update."""
        return {}

    def stats(self) -> dict[str, Any]:
        """The engine's counters, plus ``flower_properties``: each client's properties from
        the app's query handler (by client id), when the app has one."""
        out = super().stats()
        props = self._flower_executor.properties
        if props:
            out["flower_properties"] = {client_id(c): dict(v) for c, v in sorted(props.items())}
        return out


__all__ = ["FlowerLoopExecutor", "FlowerPoolExecutor", "FlowerSimulation"]
