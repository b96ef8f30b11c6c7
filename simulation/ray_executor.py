"""Simulated clients' training on a Ray cluster: the loop executor, spread over Ray actors.

Past one machine the process pool stops scaling; Ray (https://docs.ray.io) places workers on
every node of a cluster and moves objects between them. :class:`RayExecutor` keeps the
simulator's contract: each job is trained by the deployment's own
:class:`~murmura.client.TorchTrainer` (one torch thread per actor), so results are
bit-identical to :class:`~murmura.simulation.execution.LoopExecutor` for the same (parameters,
settings, seed).

What travels, and how often:

* **once per executor**: the model factory, the training data and every client's index array,
  put in the object store once; each actor reads them once when it starts (a node fetches an
  object once, and numpy arrays are read in place from its shared memory);
* **once per batch** (one :meth:`RayExecutor.run`): every distinct global vector, put once and
  passed by reference to every task that trains from it;
* **per task**: a list of (client, vector number, seed) triples for several clients, so the
  per-call overhead of Ray is paid once per group of clients, not once per client; back come
  the trained vectors stacked in one array.

On GPUs (``device='cuda'``) each actor asks Ray for a share of a GPU (:func:`actor_options`:
the cluster's GPUs over the actors, so ``workers`` actors share them evenly; ``workers=0``
starts one actor per GPU) and builds its trainers on ``cuda``, the GPU Ray assigned it.

``vectorise=True``: each actor holds a :class:`~murmura.simulation.vectorised.VectorisedExecutor`
instead of the loop, and a task is one actor's share of the batch, trained as vmapped chunks on
the actor's device (a GPU of the cluster, its chunk size sized there when ``chunk_size=0``).
Results then match the vectorised path's (to float32 rounding), not the loop's bit for bit.

Ray is an optional dependency (``pip install "murmura[ray]"``), imported when an executor is
built.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from murmura.protocols import FlatVector, TaskSettings
from murmura.simulation.config import CPU_CHUNK
from murmura.simulation.execution import (
    Executor,
    Index,
    Job,
    JobResult,
    LoopExecutor,
    ModelFactory,
    default_workers,
)
from murmura.tasks import ArrayDataset

log = logging.getLogger(__name__)

MISSING_RAY = 'Ray is not installed: pip install "murmura[ray]"'
#: Tasks in flight per actor: one running, one queued behind it so the actor never waits on
#: the driver between tasks.
IN_FLIGHT_PER_ACTOR = 2
#: Tasks per actor per batch when ``jobs_per_task`` is automatic: enough to balance actors of
#: different speeds, few enough that Ray's per-task cost stays small next to training.
TASKS_PER_ACTOR = 4

Triple = tuple[int, int, int]  # (client, index of its global vector in the task's args, seed)


def actor_options(device: str, workers: int, resources: Mapping[str, float], *,
                  where: str = "the Ray cluster") -> tuple[int, dict[str, float]]:
    """How many actors to start and the resources each asks Ray for.

    ``resources`` is ``ray.cluster_resources()``. On the CPU: ``workers`` actors (0: one per
    CPU; never more than the CPUs, or an actor would wait forever), one CPU each. On CUDA:
    ``workers`` actors (0: one per GPU) sharing the cluster's GPUs evenly, each asking for
    ``GPUs / actors`` of one (at most a whole one, rounded down to Ray's 1e-4 resolution),
    and still one CPU.
    """
    cpus = int(resources.get("CPU", 0))
    if cpus < 1:
        raise ValueError(f"{where} has no CPUs to train on")
    if device == "cpu":
        count = workers or cpus
        if count > cpus:
            log.warning("workers=%d but %s has %d CPUs: starting %d actors", count, where,
                        cpus, cpus)
        return min(count, cpus), {"num_cpus": 1}
    if not device.startswith("cuda"):
        raise ValueError(f"Ray actors train on the CPU or on CUDA GPUs, not on {device!r}")
    gpus = float(resources.get("GPU", 0))
    if gpus <= 0:
        raise ValueError(f"device={device!r} but {where} has no GPUs")
    count = min(workers or max(1, int(gpus)), cpus)
    share = min(1.0, math.floor(gpus / count * 10_000) / 10_000)
    return count, {"num_cpus": 1, "num_gpus": share}


def import_ray() -> Any:
    """``import ray``, or a :class:`ValueError` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        if exc.name == "ray":
            raise ValueError(MISSING_RAY) from None
        raise ValueError(f"Ray could not be imported ({exc}); reinstall it: "
                         'pip install "murmura[ray]"') from exc
    return ray


class _RayWorker:
    """The body of one Ray actor: a :class:`LoopExecutor` over the shared data, or (with
    ``chunk_size`` set) a vectorised executor that trains each task as vmapped chunks."""

    def __init__(self, shared: tuple[ModelFactory, ArrayDataset, Sequence[Index]],
                 threads: int, device: str = "cpu", chunk_size: int | None = None) -> None:
        torch.set_num_threads(threads)
        factory, train, shares = shared
        # on CUDA, "cuda" is the GPU Ray gave this actor (it sets CUDA_VISIBLE_DEVICES)
        where = "cuda" if device.startswith("cuda") else "cpu"
        self.loop: LoopExecutor | None = None
        self.vec: Executor | None = None
        if chunk_size is None:
            self.loop = LoopExecutor(factory, train, shares, device=where)
        else:
            from murmura.simulation.vectorised import VectorisedExecutor

            self.vec = VectorisedExecutor(factory, train, shares, chunk_size=chunk_size,
                                          device=where)

    def ready(self) -> bool:
        return True

    def train(self, batch: list[Triple], settings: TaskSettings, *vectors: FlatVector
              ) -> tuple[np.ndarray, list[int], list[dict[str, float]]]:
        # vectors come read-only from the object store; the trainer wants writable arrays
        starts = [np.array(v, dtype=np.float32) for v in vectors]
        jobs = [Job(client, starts[k], seed) for client, k, seed in batch]
        if self.vec is not None:
            results = self.vec.run(jobs, settings)
        else:
            assert self.loop is not None
            results = [self.loop.run_one(job, settings) for job in jobs]
        return (np.stack([r.params for r in results]), [r.num_examples for r in results],
                [r.metrics for r in results])


class RayExecutor(Executor):
    """The loop executor on Ray actors: ``workers`` actors, one CPU and one torch thread each.

    ``address=None`` starts a private local Ray with ``workers`` CPUs (default: one per core)
    that :meth:`close` shuts down; an address (``"auto"``, ``"HOST:6379"``,
    ``"ray://HOST:10001"``) connects to a running cluster, and ``workers`` defaults to its CPU
    count. If this process is already connected to Ray (``ray.init`` was called), that
    connection is used and left open. Every node must have the same murmura and torch
    installed as this one.

    ``jobs_per_task`` (0: automatic) is how many clients one Ray task trains. ``device``
    ``cuda`` puts the actors' trainers on GPUs (:func:`actor_options`). ``vectorise`` makes
    each actor train its tasks as vmapped chunks of up to ``chunk_size`` clients (0: sized
    from the actor's free GPU memory on CUDA), one task per actor per batch by default.
    """

    path = "ray"

    def __init__(self, model_factory: ModelFactory, train: ArrayDataset,
                 shares: Sequence[Index], *, address: str | None = None, workers: int = 0,
                 jobs_per_task: int = 0, threads_per_worker: int = 1,
                 start_timeout_s: float = 300.0, device: str = "cpu",
                 vectorise: bool = False, chunk_size: int = CPU_CHUNK) -> None:
        if workers < 0 or jobs_per_task < 0:
            raise ValueError(f"workers and jobs_per_task must be >= 0, got {workers} and "
                             f"{jobs_per_task}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"Ray actors train on the CPU or on CUDA GPUs, not on {device!r}")
        if chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 1, or 0 (auto), got {chunk_size}")
        ray = import_ray()
        self._ray = ray
        self.device_name = device
        self.vectorise = vectorise
        self.chunk_size = chunk_size if vectorise else 0
        self.jobs_per_task = jobs_per_task
        self._owns_ray = False
        self._actors: list[Any] = []
        if ray.is_initialized():
            self.where = "the Ray this process is connected to"
        else:
            self._init(ray, address, workers)
        try:
            self._start_actors(ray, model_factory, train, shares, workers, threads_per_worker,
                               start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _init(self, ray: Any, address: str | None, workers: int) -> None:
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
        if address:
            kwargs["address"] = address
            self.where = f"the Ray cluster at {address}"
        else:  # "local": a new instance even when RAY_ADDRESS points at a cluster
            kwargs.update(address="local", num_cpus=workers or default_workers())
            self.where = f"a local Ray with {kwargs['num_cpus']} CPUs"
        from murmura.server.raybackend import init_ray

        try:
            init_ray(ray, **kwargs)  # keeps our SIGINT/SIGTERM handlers
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ValueError(f"could not start or reach Ray ({self.where}): {exc}") from exc
        self._owns_ray = True

    def _start_actors(self, ray: Any, model_factory: ModelFactory, train: ArrayDataset,
                      shares: Sequence[Index], workers: int, threads: int,
                      timeout_s: float) -> None:
        count, options = actor_options(self.device_name, workers, ray.cluster_resources(),
                                       where=self.where)
        shared = ray.put((model_factory, train, list(shares)))  # shipped once, read by all
        # No actor restarts: an actor lost with its node fails the batch (and the run) loudly.
        actor = ray.remote(**options)(_RayWorker)
        chunk = self.chunk_size if self.vectorise else None
        self._actors = [actor.remote(shared, threads, self.device_name, chunk)
                        for _ in range(count)]
        self.gpus_per_actor = options.get("num_gpus", 0.0)
        try:
            ray.get([a.ready.remote() for a in self._actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(f"{count} Ray actors did not start within {timeout_s:g} s on "
                             f"{self.where}") from None
        self.workers = count
        self.threads = threads

    # -- running -------------------------------------------------------------------------

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        if not jobs:
            return []
        if not self._actors:
            raise RuntimeError("the Ray executor is closed")
        ray = self._ray
        keys: dict[int, int] = {}
        refs: list[Any] = []  # one object-store copy of each distinct global vector
        items: list[Triple] = []
        for job in jobs:
            key = keys.get(id(job.params))
            if key is None:
                key = keys[id(job.params)] = len(refs)
                refs.append(ray.put(job.params))
            items.append((job.client, key, job.seed))
        # the loop: several tasks per actor balance actors of different speeds; vmapped
        # chunks: one task per actor, as large a chunk as the batch gives it
        tasks = self.workers * (1 if self.vectorise else TASKS_PER_ACTOR)
        per = self.jobs_per_task or max(1, -(-len(items) // tasks))
        batches = [items[s:s + per] for s in range(0, len(items), per)]
        out: list[tuple[np.ndarray, list[int], list[dict[str, float]]] | None] = \
            [None] * len(batches)
        pending: dict[Any, tuple[int, Any]] = {}
        queue = iter(range(len(batches)))

        def submit(actor: Any) -> None:
            b = next(queue, None)
            if b is None:
                return
            needed = sorted({k for _, k, _ in batches[b]})
            local = {k: i for i, k in enumerate(needed)}
            ref = actor.train.remote([(c, local[k], s) for c, k, s in batches[b]], settings,
                                     *(refs[k] for k in needed))
            pending[ref] = (b, actor)

        for _ in range(IN_FLIGHT_PER_ACTOR):
            for actor in self._actors:
                submit(actor)
        while pending:  # an actor that finishes a task gets the next one
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                b, actor = pending.pop(ref)
                out[b] = ray.get(ref)
                submit(actor)
        results: list[JobResult] = []
        for part in out:
            assert part is not None
            stacked, counts, metrics = part
            stacked = np.array(stacked)  # writable, and no longer pinning the object store
            results += [JobResult(stacked[i], counts[i], dict(metrics[i]))
                        for i in range(len(counts))]
        return results

    def describe(self) -> str:
        gpus = getattr(self, "gpus_per_actor", 0.0)
        on = f", {gpus:g} GPU" if gpus else ""
        what = (f"vmapped chunks of up to {self.chunk_size or 'auto'} clients"
                if getattr(self, "vectorise", False) else "TorchTrainer")
        return (f"ray ({getattr(self, 'workers', 0)} actors running {what}, "
                f"{getattr(self, 'threads', 1)} thread{on} each, on {self.where})")

    def close(self) -> None:
        """Stop the actors; shut Ray down if this executor started it."""
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone with its node: nothing left to stop
                log.debug("could not kill a Ray actor", exc_info=True)
        self._actors = []
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


__all__ = ["MISSING_RAY", "RayExecutor", "actor_options", "import_ray"]
