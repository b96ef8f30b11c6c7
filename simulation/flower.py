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
from murmura.simulation.engine import Simulation
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

    def trainer(self, client: int) -> Any:
        from murmura.client.flower_load import load_flower_client

        if client not in self._trainers:
            self._trainers[client] = load_flower_client(
                self.ref, client_index=client, num_clients=self.num_clients,
                run_config_overrides=self.run_config, seed=self.seed)
        return self._trainers[client]

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


def _run_in_worker(jobs: list[Job], settings: TaskSettings, version: int) -> list[JobResult]:
    assert _WORKER is not None, "worker was not initialised"
    return [_WORKER.run_one(job, settings, version) for job in jobs]


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
            for i, result in zip(idx, futures[w].result(), strict=True):
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
        from murmura.server.flower import flower_config

        if server.train.client_eval_every:
            raise ValueError("client_eval_every: a simulated Flower app is evaluated by the "
                             "server with its evaluate handler; evaluation on the virtual "
                             "clients is not supported yet")
        if sim.executor not in ("auto", "loop", "pool") or sim.vectorise == "on":
            raise ValueError(f"a Flower app runs in the loop or pool executor "
                             f"(executor={sim.executor!r}, vectorise={sim.vectorise!r} asked)")
        self.ref, self.run_config = ref, run_config
        server, self._app_trainer = flower_config(server, ref, run_config=run_config,
                                                  given=given)
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


__all__ = ["FlowerLoopExecutor", "FlowerPoolExecutor", "FlowerSimulation"]
