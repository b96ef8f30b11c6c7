"""How simulated clients' local training runs: in a plain loop, or in a process pool.

Every executor takes a batch of :class:`Job` (which client, which global vector, which seed)
and returns each client's trained model. The loop and the pool run the deployment's own
:class:`~murmura.client.TorchTrainer` on each client's share of the data, so their updates are
bit-identical to what a gRPC client computes from the same (parameters, settings, seed). The
vectorised executor (:mod:`murmura.simulation.vectorised`) trains many clients at once instead.

On an accelerator (``device='cuda'``) the loop builds each trainer on that device, as a
``murmura client --device cuda`` does (the zeroth-order trainer's fused CUDA kernels included),
in float32 (``amp='off'``: a client's autocast default on CUDA is bf16; the simulator keeps
the CPU's arithmetic, so a GPU run's updates match a CPU run's within float32 rounding) unless
the simulation asks for ``amp='bf16'`` (``SimulationConfig.amp``).
The pool refuses one: its workers are forked CPU processes, and forked children can't share the
parent's CUDA context; use the loop (or vmap) there.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from murmura.client import TorchTrainer, ZOTrainer
from murmura.client.app import AppTrainer
from murmura.protocols import FlatVector, TaskSettings
from murmura.tasks import ArrayDataset, Task
from murmura.tasks.app import AppTask

log = logging.getLogger(__name__)

Index = npt.NDArray[np.int64]
ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class Job:
    """One client's local training: start from ``params`` (shared, never modified)."""

    client: int
    params: FlatVector
    seed: int
    #: Local steps the server assigned this task (FedCompass); 0: the settings' own.
    steps: int = 0


@dataclass
class JobResult:
    """The client's trained model and what its trainer reports.

    ``params`` passes to the caller: the simulator computes the client's update in its
    memory (when it is a writable float32 array), so an executor must not keep using it."""

    params: FlatVector
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    #: ``(codec, payload)`` when the trainer encoded the update itself (the zeroth-order
    #: trainer's seed-based step log); the engine pushes it as it is
    encoded: tuple[str, bytes] | None = None


class Executor(ABC):
    """Runs batches of jobs. ``path`` names the execution path for logs and summaries,
    ``device_name`` where the training runs and ``chunk_size`` how many clients one batch
    on that device trains at once (0: not batched), both for the summary."""

    path: str = ""
    device_name: str = "cpu"
    chunk_size: int = 0

    @abstractmethod
    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        """Train every job; results in the order of ``jobs``."""

    def describe(self) -> str:
        return self.path

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers."""


class LoopExecutor(Executor):
    """One :class:`TorchTrainer` per job, one after another, sharing one model object.

    Exactly the trainer a ``murmura client`` runs: the same batches, the same optimizer, the
    same float operations; only the data share changes from job to job.
    """

    path = "loop"

    def __init__(self, model_factory: ModelFactory, train: ArrayDataset,
                 shares: Sequence[Index], *, task: Task | None = None,
                 device: str = "cpu", amp: str = "off") -> None:
        from murmura.simulation.config import resolve_device

        self.device_name = resolve_device(device)
        self.amp = amp  # the first-order trainer's (TorchTrainer's amp)
        self.model = model_factory()
        self.train = train
        self.shares = shares
        self._zo: ZOTrainer | None = None
        #: An app with its own ``train``: each job runs it on the deployed client's own data
        #: (``client_data(i, n)``, as ``murmura client`` loads it), not on gathered arrays.
        self._app = task if isinstance(task, AppTask) and task.app.fn("train") is not None \
            else None
        self._app_data: dict[int, Any] = {}
        #: An app's own ``loss`` (Murmura's trainer minimises it, as on a deployed client).
        self._loss = task.app.fn("loss") if isinstance(task, AppTask) else None

    def run_one(self, job: Job, settings: TaskSettings) -> JobResult:
        trainer: TorchTrainer | ZOTrainer | AppTrainer
        if self._app is not None:
            data = self._app_data.get(job.client)
            if data is None:
                data = self._app_data[job.client] = self._app.client_data(job.client,
                                                                          len(self.shares))
            trainer = AppTrainer(self._app, self.model, data)
            result = trainer.train(job.params, settings, seed=job.seed)
            assert result.params is not None
            return JobResult(result.params, result.num_examples, dict(result.metrics))
        data = self.train.subset(self.shares[job.client])
        if settings.trainer == "zo":
            # the client's own seed-based trainer: it returns the step log it would push
            # (and the exact model the server's replay of it gives)
            if self._zo is None:
                self._zo = ZOTrainer(self.model, data, device=self.device_name)
            trainer = self._zo
            trainer.data = data
        elif self._loss is not None:
            trainer = TorchTrainer(self.model, data, device=self.device_name,
                                   loss_fn=self._loss, amp=self.amp)
        else:
            trainer = TorchTrainer(self.model, data, device=self.device_name, amp=self.amp)
        result = trainer.train(job.params, settings, seed=job.seed)
        assert result.params is not None
        return JobResult(result.params, result.num_examples, dict(result.metrics),
                         encoded=result.encoded)

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        return [self.run_one(job, settings) for job in jobs]

    def describe(self) -> str:
        where = "" if self.device_name == "cpu" else f" on {self.device_name}"
        amp = ", bf16 autocast" if self.amp == "bf16" else ""
        return f"loop{where} (the client's trainer, one client at a time{amp})"


# -- process pool ----------------------------------------------------------------------------

_WORKER: LoopExecutor | None = None


def _init_worker(model_factory: ModelFactory, train: ArrayDataset,
                 shares: Sequence[Index], threads: int, task: Task | None,
                 amp: str = "off") -> None:
    global _WORKER
    torch.set_num_threads(threads)
    _WORKER = LoopExecutor(model_factory, train, shares, task=task, amp=amp)


def _run_in_worker(batch: list[tuple[int, int, int]], vectors: dict[int, FlatVector],
                   settings: TaskSettings) -> list[JobResult]:
    assert _WORKER is not None, "worker was not initialised"
    return [_WORKER.run_one(Job(client, vectors[key], seed), settings)
            for client, key, seed in batch]


class PoolExecutor(Executor):
    """The loop, split over worker processes (forked, one torch thread each).

    For models the vectorised path can't run. Each worker holds its own model and reads the
    training data inherited from this process at fork time; jobs travel as (client, seed) plus
    the distinct global vectors they start from.
    """

    path = "pool"

    def __init__(self, model_factory: ModelFactory, train: ArrayDataset,
                 shares: Sequence[Index], *, workers: int, threads_per_worker: int = 1,
                 task: Task | None = None, device: str = "cpu", amp: str = "off") -> None:
        if workers < 2:
            raise ValueError(f"a process pool needs at least 2 workers, got {workers}")
        if device != "cpu":
            raise ValueError(f"the process pool runs forked CPU processes and can't train on "
                             f"device={device!r} (forked children can't share a CUDA "
                             f"context); use the loop or vmap executor on an accelerator")
        import multiprocessing as mp

        self.workers = workers
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                         initargs=(model_factory, train, shares,
                                                   threads_per_worker, task, amp))
        self.amp = amp

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        if not jobs:
            return []
        keys: dict[int, int] = {}
        vectors: dict[int, FlatVector] = {}
        items = []
        for job in jobs:
            key = keys.setdefault(id(job.params), len(keys))
            vectors[key] = job.params
            items.append((job.client, key, job.seed))
        per = max(1, -(-len(items) // (self.workers * 4)))
        futures = []
        for start in range(0, len(items), per):
            batch = items[start:start + per]
            needed = {k: vectors[k] for _, k, _ in batch}
            futures.append(self._pool.submit(_run_in_worker, batch, needed, settings))
        results: list[JobResult] = []
        for fut in futures:
            results += fut.result()
        return results

    def describe(self) -> str:
        amp = ", bf16 autocast" if self.amp == "bf16" else ""
        return (f"pool ({self.workers} worker processes running the client's trainer, 1 "
                f"thread each{amp})")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def check_own_trainer_path(what: str, executor: str, vectorise: str, *,
                           vectorised: bool = False) -> None:
    """Refuse the paths a client's own trainer (the zeroth-order trainer, an app's own train
    or loss) cannot take: it runs in the loop or the pool executor, not on Ray, and not
    vectorised unless ``vectorised`` (the zeroth-order trainer has a vectorised twin)."""
    if executor == "ray" or (not vectorised and (executor == "vmap" or vectorise == "on")):
        paths = "the loop, pool or vmap executor" if vectorised else "the loop or pool executor"
        raise ValueError(f"{what} runs in {paths} "
                         f"(executor={executor!r}, vectorise={vectorise!r} asked)")


def has_own_train(task: Task | None) -> bool:
    """Whether ``task`` is an app that brings its own ``train`` or ``loss`` function (the
    vectorised path trains with cross-entropy and Murmura's SGD only)."""
    return isinstance(task, AppTask) and (task.app.fn("train") is not None
                                          or task.app.fn("loss") is not None)


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


__all__ = ["Executor", "Job", "JobResult", "LoopExecutor", "PoolExecutor", "default_workers"]
