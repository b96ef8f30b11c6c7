"""What the virtual clients send: their training, evaluation and encoding, in batches.

The engine (:mod:`.engine`) decides *when* a client trains and pushes; this job makes the
update it pushes, as the deployed client would make it:

* **training** is lazy and batched: a client's update depends only on (global vector, data,
  seed), all known when it pulls, so jobs queue up and every queued job is trained at once
  when the first result is needed (the batch the vectorised executor trains together);
* **evaluation on the client** (``settings.client_eval_every``): the global model a task
  starts from is measured on the client's local test split, with the rule and the split of
  :class:`~murmura.client.app.EvaluatingTrainer` (the app's ``client_test_data``, else the
  same seeded hold-out of the client's share, which it then no longer trains on), and the
  figures travel with the update as ``eval_*`` metrics;
* **encoding**: each client's encoder, made and seeded from its id as
  :class:`~murmura.client.ClientRuntime` makes it, its ``auto`` codec choice, and the
  malicious clients' update transforms and the harness's ``update_hook`` before encoding.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from murmura.client import delta_of
from murmura.client.rules import auto_switch, encoder_seed, make_encoder
from murmura.client.trainer import count_examples
from murmura.protocols import Encoder, FlatVector, TaskSettings, create_codec
from murmura.simulation.attacks import UpdateBatch, check_update
from murmura.simulation.data import SimulationData
from murmura.simulation.execution import Job, JobResult
from murmura.simulation.vectorised import VectorisedExecutor
from murmura.tasks import ArrayDataset
from murmura.tasks.app import holdout

if TYPE_CHECKING:
    from murmura.simulation.clients import _Flight


def split_for_client_eval(data: SimulationData, seed: int) -> tuple[SimulationData,
                                                                     list[Any]]:
    """Each client's local test split and the data it trains on from then on.

    As a deployed client decides it (:class:`~murmura.client.app.EvaluatingTrainer`): the
    task's own ``client_test_data(index, clients)``, else a seeded hold-out of the client's
    share (``holdout`` with seed ``seed * 1_000_003 + index``), which leaves the share. The
    hold-out of a share depends on its labels only, so it is drawn on positions and maps back
    to the share's indices. A client with neither gets ``None`` and is not evaluated.
    """
    n = len(data.shares)
    train = data.train
    shares = list(data.shares)
    tests: list[Any] = [None] * n
    for c in range(n):
        own = data.task.client_test_data(c, n)
        if own is not None:
            tests[c] = own
            continue
        share = shares[c]
        positions = ArrayDataset(np.arange(len(share), dtype=np.float32).reshape(-1, 1),
                                 train.y[share])
        split = holdout(positions, seed=seed * 1_000_003 + c)
        if split is None:
            continue
        keep, test = (share[part.x[:, 0].astype(np.int64)] for part in split)
        shares[c] = keep
        tests[c] = train.subset(test)
    return dataclasses.replace(data, shares=shares), tests


class UpdatesJob:
    """The virtual clients' updates: the engine's methods that train, evaluate and encode
    (mixed into :class:`~murmura.simulation.engine.Simulation`)."""

    #: attributes this job assigns (the engine declares the rest)
    _client_tests: list[Any] | None
    _evaluated: dict[int, int]
    _eval_model: nn.Module | None
    _pending: list[int]
    train_wall_s: float
    batches: int
    batched_jobs: int

    if TYPE_CHECKING:  # the engine's state, typed where Simulation declares it
        flights: dict[int, _Flight]
        settings: TaskSettings

        def __getattr__(self, name: str) -> Any: ...

    # -- timing and codecs -----------------------------------------------------------------

    def _compute_time(self, c: int, flight: _Flight) -> float:
        """Virtual seconds client ``c`` trains this task: the server's step assignment
        (FedCompass) at its speed, else its usual task time."""
        if flight.steps:
            return flight.steps * float(self.devices.step_time_s[c])
        return float(self._compute_s[c])

    def _choose_codec(self, c: int, flight: _Flight) -> None:
        """``client_codec='auto'``: after a client's first push, its codec for the next
        updates from that push's virtual duration, by the client runtime's own rule."""
        self._auto.discard(c)
        if flight.codec or flight.header is None:  # the trainer encoded it itself
            return
        push_s = self._latency[c] + flight.wire / self._up[c]
        current = self._client_codec or self.settings.codec
        choice = auto_switch(4 * self.spec.size, flight.header.payload_bytes, push_s,
                             self._compute_time(c, flight), current)
        if choice is not None:
            name, options = choice
            self._codec_of[c] = name
            self._encoders[c] = create_codec(name, options).encoder(
                self.spec.size, seed=encoder_seed(self.ids[c]))

    def _encoder(self, c: int) -> Encoder:
        if self._shared_encoder is not None:
            return self._shared_encoder  # type: ignore[no-any-return]
        enc: Encoder | None = self._encoders.get(c)
        if enc is None:  # made and seeded as ClientRuntime makes it, from the client id
            enc = self._encoders[c] = make_encoder(self.settings, self.spec.size, self.ids[c],
                                                   self._client_codec)
        return enc

    # -- training --------------------------------------------------------------------------

    def _train_pending(self) -> None:
        """Train every queued job in one batch, then encode each client's update."""
        clients = [c for c in dict.fromkeys(self._pending)
                   if c in self.flights and self.flights[c].payload is None
                   and self.flights[c].params is not None]
        self._pending = []
        if not clients:
            return
        jobs = [Job(c, self.flights[c].params, self.flights[c].seed,  # type: ignore[arg-type]
                    self.flights[c].steps) for c in clients]
        reports = self._client_eval(clients) if self._client_tests is not None else {}
        t0 = time.perf_counter()
        results = self._run_jobs(clients, jobs)
        self.train_wall_s += time.perf_counter() - t0
        self.batches += 1
        self.batched_jobs += len(jobs)
        for c, r in zip(clients, results, strict=True):
            if c in reports:
                r.metrics.update(reports[c])
        if self._update_attacks or self.update_hook is not None:
            self._encode_attacked(clients, jobs, results)
            return
        for c, job, r in zip(clients, jobs, results, strict=True):
            flight = self.flights[c]
            if r.encoded is not None:  # the trainer's own payload (a seed-based step log)
                flight.codec, flight.payload = r.encoded
            else:
                update = _delta(r.params, job.params)
                encoder = self._encoder(c)
                view = encoder.encode_view(update)  # dense-f32: the delta's own bytes
                flight.payload = view if view is not None else encoder.encode(update)
            flight.num_examples = r.num_examples
            flight.metrics = dict(r.metrics)
            flight.params = None  # the global vector is no longer needed by this client

    def _run_jobs(self, clients: list[int], jobs: list[Job]) -> list[JobResult]:
        """Train the jobs; tasks with server-assigned local steps (FedCompass) run in one
        batch per step count, each with the settings the client runtime would use."""
        steps = [self.flights[c].steps for c in clients]
        if not any(steps) or (isinstance(self.executor, VectorisedExecutor) and all(steps)):
            return self.executor.run(jobs, self.settings)  # type: ignore[no-any-return]
        results: list[JobResult | None] = [None] * len(jobs)
        for k in sorted(set(steps)):
            idx = [i for i, s in enumerate(steps) if s == k]
            settings = (dataclasses.replace(self.settings, local_steps=k) if k
                        else self.settings)
            group = [dataclasses.replace(jobs[i], steps=0) for i in idx]
            for i, r in zip(idx, self.executor.run(group, settings), strict=True):
                results[i] = r
        return results  # type: ignore[return-value]

    def _encode_attacked(self, clients: list[int], jobs: list[Job],
                         results: list[JobResult]) -> None:
        """:meth:`_train_pending`'s encoding when attacks or a hook are configured: each
        client's update transform (where the runtime calls its ``update_hook``), then the
        harness hook on the whole batch, then encoding."""
        size = self.spec.size
        updates = [delta_of(r.params, job.params) for job, r in zip(jobs, results, strict=True)]
        for i, c in enumerate(clients):
            transform = self._update_attacks.get(c)
            if transform is not None:
                updates[i] = check_update(transform(updates[i]), size, c, "the update attack")
        if self.update_hook is not None:
            for u in updates:
                u.flags.writeable = False  # hooks return replacements
            batch = UpdateBatch(
                time_s=self.clock.now, clients=tuple(clients),
                versions=tuple(self.flights[c].version for c in clients),
                rounds=tuple(self.flights[c].round for c in clients),
                num_examples=tuple(r.num_examples for r in results),
                bases=tuple(job.params for job in jobs), updates=tuple(updates))
            replaced = self.update_hook(batch) or {}
            position = {c: i for i, c in enumerate(clients)}
            for c, u in replaced.items():
                if c not in position:
                    raise ValueError(f"update_hook replaced the update of client {c!r}, which "
                                     f"is not in this batch (clients {list(clients)})")
                updates[position[c]] = check_update(u, size, c, "update_hook")
        for c, r, update in zip(clients, results, updates, strict=True):
            flight = self.flights[c]
            flight.payload = self._encoder(c).encode(update)
            flight.num_examples = r.num_examples
            flight.metrics = dict(r.metrics)
            flight.params = None

    # -- evaluation on the client ------------------------------------------------------------

    def _client_eval(self, clients: list[int]) -> dict[int, dict[str, float]]:
        """The ``eval_*`` figures of the clients in this batch whose turn it is: once every
        ``client_eval_every`` versions, on the global model their task starts from."""
        every = self.settings.client_eval_every
        tests = self._client_tests
        assert tests is not None
        due: dict[int, list[int]] = {}
        for c in clients:
            if tests[c] is None:
                continue
            version, last = self.flights[c].version, self._evaluated.get(c)
            if last is None or version // every > last // every:
                due.setdefault(version, []).append(c)
        reports: dict[int, dict[str, float]] = {}
        task = self.data.task
        for version, members in due.items():  # one model load per version measured
            params: FlatVector = self.flights[members[0]].params  # type: ignore[assignment]
            if self._eval_model is None:
                self._eval_model = task.build_model()
            self.spec.load_into(self._eval_model, params)
            for c in members:
                figures = task.evaluate(self._eval_model, tests[c])
                self._evaluated[c] = version
                report = {"eval_version": float(version),
                          "eval_examples": float(_examples(tests[c]))}
                report.update({f"eval_{k}": float(v) for k, v in figures.items()})
                reports[c] = report
        return reports


def _delta(trained: FlatVector, base: FlatVector) -> FlatVector:
    """The client's update, computed in the trained vector's own memory where it may be (a
    result's row is not used again once its update is made): no new array per client, whose
    pages would fault in (a 4 MB update costs more in faults than in arithmetic). A read-only
    vector (a Ray object), one that may share memory with the base, or another dtype gets a
    new array, as :func:`~murmura.client.trainer.delta_of` makes it."""
    if trained.dtype == np.float32 and trained.flags.writeable and trained.shape == base.shape \
            and not np.may_share_memory(trained, base):
        return np.subtract(trained, base, out=trained)
    return delta_of(trained, base)


def _examples(data: Any) -> int:
    """How many examples a local test split holds (1 when it cannot tell, as the client)."""
    try:
        return len(data[1]) if isinstance(data, tuple) else count_examples(data)
    except (ValueError, TypeError, IndexError):
        return 1


__all__ = ["UpdatesJob", "split_for_client_eval"]
