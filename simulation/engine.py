"""The discrete-event engine: virtual clients driving the real aggregator core in virtual time.

Each client follows the loop of :class:`~murmura.client.ClientRuntime` (join, ask for a task,
pull, train, encode, push, ask again), and each step is an event at the virtual time it would
happen on its device and link:

* a request reaches the server one latency after it is sent; the answer is back one latency
  later, so consecutive requests are two latencies apart;
* a pull adds the model's wire bytes over the downlink; a push adds the update's wire bytes
  over the uplink (the bytes the gRPC transport would send, see :mod:`.wire`);
* training takes ``steps x seconds-per-step`` of the client's device;
* an unanswered task request is a long poll: the server holds it until its answer changes (a
  round opens, the run ends), as the gRPC servicer does;
* going offline loses the work in progress; coming back online joins again;
* a refused request is handled as :class:`~murmura.client.ClientRuntime` handles it
  (:func:`~murmura.client.rules.after_refusal`): re-join and send it again, retry it after
  the :class:`~murmura.client.RetryPolicy` pause (jitter drawn from the client's own stream,
  :func:`~murmura.client.jitter_rng`, so reruns are identical; at least the server's retry
  hint) scheduled in virtual time, or drop the work and ask for the next task.

Encoders, update ids and refusals follow :mod:`murmura.client.rules`, as the client runtime
does. Malicious clients run the attacks a deployed malicious client runs
(``attacks={index: Attack}``), and harness-level attacks (ALIE, IPM, Sybil floods) replace
updates through ``update_hook`` (see :mod:`murmura.simulation.attacks`).

At each server-side event the engine calls what the gRPC servicer calls (the core's ``join``,
``task``, ``model``, ``leave``, ``tick`` at the policy's deadline, and the push pipeline,
:class:`~murmura.server.pipeline.PushPipeline`), with the core's clock set to the virtual
clock, so sync rounds, FedBuff buffers, staleness, deadlines and refusals come out of the event
order exactly as they would from the network.

What a client pushes (its batched training, evaluation on the client, encoding) is made in
:mod:`.updates`; who the clients are (devices, availability, the executor) in
:mod:`.population`; the reporting in :mod:`.results`. Idle clients hold no model: per client
there is an id, a session, an index array into the shared data, a few numbers in arrays, and
an encoder only when the codec keeps state.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import random
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from murmura.client import Backoff, RetryPolicy
from murmura.client.malicious import Attack
from murmura.client.rules import UpdateIds, codec_choice, make_encoder
from murmura.protocols import (
    Encoder,
    ModelSpec,
    TaskSettings,
    create_codec,
)
from murmura.server import AggregatorCore, ServerConfig, build_core
from murmura.server.secagg_policy import SecAggAsyncPolicy, SecAggPolicy
from murmura.simulation.attacks import BatchHook, check_attacks, poison_data
from murmura.simulation.clients import (
    _LOCAL,
    _ONLINE,
    _TICK,
    ClientEventsJob,
    _Flight,
)
from murmura.simulation.clock import EventQueue, VirtualClock
from murmura.simulation.config import SimulationConfig, output_dir
from murmura.simulation.data import SimulationData, load_simulation_data
from murmura.simulation.execution import Executor, default_workers
from murmura.simulation.population import availability, choose_executor, device_population
from murmura.simulation.results import ResultsJob, SimulationResult, plot_staleness
from murmura.simulation.secagg import SecAggDriver
from murmura.simulation.updates import UpdatesJob, split_for_client_eval
from murmura.simulation.wire import ModelWire
from murmura.tasks import TaskConfig

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.npz"
#: Receive buffers the simulated server keeps between rounds, in bytes (see _build_core).
KEEP_BUFFER_BYTES = 8 << 30
#: The cyclic collector's first threshold while the event loop runs. Each event allocates a
#: few short-lived objects (headers, results, closures) that reference counting frees; at
#: Python's default (700) the collector ran ~370 times per 10,000-client round and walked the
#: run's long-lived state each time (measured: 0.05-0.1 s of a 1.2-1.4 s round).
GC_THRESHOLD = 100_000
#: Codecs whose encoders keep no state: one encoder serves every client.
STATELESS_CODECS = frozenset({"dense-f32", "dense-f16"})


def client_id(index: int) -> str:
    """The id ``murmura run`` gives client ``index`` (so sorted cohorts agree)."""
    return f"client-{index:03d}"


class Simulation(ClientEventsJob, UpdatesJob, ResultsJob):
    """One simulated federation: the aggregator core, the virtual clients and the clock.

    Build it, then :meth:`run` (or :meth:`advance` step by step and :meth:`finish`).
    ``out_dir`` defaults to ``sim.out``; pass ``None`` to write nothing.

    ``attacks`` makes clients malicious, keyed by client index, with the
    :class:`~murmura.client.malicious.Attack` a deployed malicious client runs: its data
    transform poisons the client's share, its update transform each update before encoding.
    ``update_hook(batch)`` sees every training batch (an
    :class:`~murmura.simulation.attacks.UpdateBatch`) after those transforms and returns the
    updates it replaces, for attacks that need more than one client. ``retry`` is the clients'
    :class:`~murmura.client.RetryPolicy` for retryable refusals.
    """

    def __init__(self, task: TaskConfig, server: ServerConfig, sim: SimulationConfig, *,
                 data: SimulationData | None = None, executor: Executor | None = None,
                 out_dir: str | Path | None | bool = True, evaluate: bool = True,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 attacks: Mapping[int, Attack] | None = None,
                 update_hook: BatchHook | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.task_config, self.server_config, self.sim = task, server, sim
        self.data = data if data is not None else load_simulation_data(task, sim)
        n = sim.clients
        if len(self.data.shares) != n:
            raise ValueError(f"the data is split for {len(self.data.shares)} clients, the "
                             f"simulation has {n}")
        self.attacks = check_attacks(attacks, n)
        self.data = poison_data(self.data, self.attacks)
        # evaluation on the clients: each one's local test split leaves its training share
        self._client_tests: list[Any] | None = None
        self._evaluated: dict[int, int] = {}
        self._eval_model = None
        if server.train.client_eval_every:
            self.data, self._client_tests = split_for_client_eval(self.data, task.data_seed)
        self._update_attacks = {c: a.update for c, a in self.attacks.items()
                                if a.update is not None}
        self.update_hook = update_hook
        self.retry = retry or RetryPolicy()
        self.out_dir = output_dir(sim, out_dir)
        self.progress = progress
        self.clock = VirtualClock()
        self.core = self._build_core(evaluate)
        self.spec: ModelSpec = self.core.spec
        self.settings: TaskSettings = self.core.config.train
        if self.settings.trainer == "zo" and (self._update_attacks or update_hook is not None):
            raise ValueError("attacks and hooks on updates change dense model updates; a "
                             "zeroth-order run pushes seed-based step logs (use data attacks, "
                             "or first-order training)")
        self.devices = device_population(sim, server.seed)
        self.availability = availability(sim, server.seed)
        # per-client state: a few arrays and strings, no models
        self.ids = [client_id(i) for i in range(n)]
        self.sessions = [""] * n
        self.gen = array("q", bytes(8 * n))       # bumped when a client goes offline
        self.online = array("b", bytes(n))
        sizes = self.data.sizes()
        b = self.settings.batch_size
        self.steps = (np.full(n, self.settings.local_steps, dtype=np.int64)
                      if self.settings.local_steps
                      else self.settings.local_epochs * ((sizes + b - 1) // b))
        # the hot loop reads per-client numbers from flat arrays (8 bytes per client each)
        self._latency = array("d", self.devices.latency_s.tolist())
        self._compute_s = array("d", (self.steps * self.devices.step_time_s).tolist())
        self._down = array("d", self.devices.downlink_bytes_per_s.tolist())
        self._up = array("d", self.devices.uplink_bytes_per_s.tolist())
        self.flights: dict[int, _Flight] = {}
        self.waiting: dict[int, None] = {}
        self._pending: list[int] = []
        self._encoders: dict[int, Encoder] = {}
        #: the clients' own codec (sim.client_codec; "auto": chosen per client, see _on_push)
        self._client_codec = "" if sim.client_codec == "auto" else sim.client_codec
        self._auto: set[int] = set(range(n)) if sim.client_codec == "auto" else set()
        self._codec_of: dict[int, str] = {}  # clients whose auto choice switched codec
        create_codec(*codec_choice(self.settings, self._client_codec))  # unknown: fails now
        # a dense codec draws no randomness and keeps no state: one encoder serves everyone
        first = self._client_codec or self.settings.codec
        self._shared_encoder = (make_encoder(self.settings, self.spec.size, self.ids[0],
                                             self._client_codec)
                                if first in STATELESS_CODECS and not self._auto else None)
        self.model_wire = ModelWire(self.spec)
        self.queue: EventQueue[tuple[int, int, int]] = EventQueue()
        self._ticks: set[float] = set()
        self._sig: tuple[Any, ...] = ()
        self._started = False
        self._update_ids = UpdateIds(seed=server.seed)  # reproducible, 12 characters
        # refusal state, touched only after a refusal: resumed request after a re-join, the
        # backoff of a request being retried, each retried client's jitter stream
        self._resume: dict[int, int] = {}
        self._retrying: dict[int, Backoff] = {}
        self._jitter: dict[int, random.Random] = {}
        self.gave_up = 0
        self._last_version = self.core.version
        self.rows: list[dict[str, Any]] = []
        # counters
        self.events = 0
        #: Set (e.g. by a Ctrl-C handler) to end :meth:`advance` at the next event boundary:
        #: nothing is interrupted mid-step, so the run's outputs can be written as they are.
        self.stop = threading.Event()
        self.batches = 0
        self.batched_jobs = 0
        self.train_wall_s = 0.0
        self.lost = 0
        self.refused: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.probe_note = "an executor passed in"
        if executor is None:
            executor, self.probe_note = choose_executor(sim, self.data, self.settings)
        self.executor = executor
        self.execution_path = self.executor.path
        self._wall = 0.0
        #: Secure aggregation: the same client and server state machines, in memory
        #: (simulation/secagg.py); None without it.
        self.secagg = (SecAggDriver(self.core.policy, seed=server.seed)
                       if isinstance(self.core.policy, SecAggPolicy | SecAggAsyncPolicy)
                       else None)
        self._secagg_index = {cid: i for i, cid in enumerate(self.ids)} if self.secagg else {}
        log.info("simulation: %d clients, execution: %s", n, self.executor.describe())

    # -- construction --------------------------------------------------------------------

    def _build_core(self, evaluate: bool) -> AggregatorCore:
        # The deployment's own assembly, with the virtual clock; decoding and publishing run
        # inline, so virtual time alone orders events. Every simulated client lives in this
        # process, so node identities would prove nothing: they are off (docs/security.md).
        config = self.server_config.replace(require_identity=False, allowed_keys="")
        core = build_core(config, self.task_config, out_dir=self.out_dir,
                          evaluate=evaluate, task=self.data.task, clock=self.clock,
                          checkpoint=self.sim.checkpoint, fresh_metrics=True,
                          extra_config={"simulation": dataclasses.asdict(self.sim),
                                        "data": self.data.source})
        # A sync round holds its cohort's updates until they fold in cohort order, and the
        # next round needs as many receive buffers again: keep them (up to a memory budget)
        # instead of faulting in fresh mappings every round. The peak is the same either way.
        buffers = core.pipeline.tier.buffers
        per = max(4 * core.spec.size, buffers.min_bytes)
        buffers.max_free = max(buffers.max_free, min(self.sim.clients, KEEP_BUFFER_BYTES // per))
        return core

    # -- the event loop ------------------------------------------------------------------

    def _schedule(self, t: float, kind: int, c: int) -> None:
        self.queue.push_trusted(t, (kind, c, self.gen[c]))

    def _start(self) -> None:
        self._started = True
        for c in range(self.sim.clients):
            online, t = self.availability.initial(c)
            if online:
                self._schedule(0.0, _ONLINE, c)
            elif math.isfinite(t):
                self._schedule(t, _ONLINE, c)
        self._sig = self.core.task_signature()  # what held long polls wait on

    def advance(self, until_s: float = math.inf) -> bool:
        """Process events up to virtual time ``until_s``; False once the run is over."""
        threads = self.sim.threads or default_workers()
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        collector = gc.get_threshold()
        gc.set_threshold(max(collector[0], GC_THRESHOLD), *collector[1:])
        t0 = time.perf_counter()
        try:
            if not self._started:
                self._start()
            limit = min(until_s, self.sim.max_time_s or math.inf)
            handlers = (self._on_online, self._on_offline, self._on_join, self._on_task,
                        self._on_pull, self._on_done, self._on_push)
            queue, clock, core, generation = self.queue, self.clock, self.core, self.gen
            events = 0
            stop = self.stop
            while queue and not core.done and not stop.is_set():
                if queue.peek_time() > limit:
                    if math.isfinite(limit):
                        clock.advance_to(max(limit, clock.now))
                    self.events += events
                    return not (limit >= (self.sim.max_time_s or math.inf))
                t, (kind, c, gen) = queue.pop()
                clock.advance_to(t)
                events += 1
                if kind == _TICK:
                    self._ticks.discard(t)
                    core.tick()
                elif gen == generation[c]:
                    handlers[kind](c)
                    if kind in _LOCAL:
                        continue  # the core's state did not change
                else:
                    continue  # the client went offline since this event was scheduled
                self._after_event()
            self.events += events
            if not self.core.done and not self.queue and not stop.is_set():
                log.warning("simulation stalled at t=%.1fs: no client can make progress",
                            self.clock.now)
            return False
        finally:
            self._wall += time.perf_counter() - t0
            torch.set_num_threads(previous)
            gc.set_threshold(*collector)

    def _after_event(self) -> None:
        core = self.core
        if self.secagg is not None:  # a deadline may have closed the round's keys stage
            self._pump_secagg()
        if core.version != self._last_version:
            self._last_version = core.version
            if self.out_dir is None:
                self.rows.append(dict(core.last_metrics))
            if self.progress is not None:
                self.progress(core.last_metrics)
        sig = core.task_signature()
        if sig != self._sig:
            self._sig = sig
            if self.waiting:
                self._wake()
                self._sig = core.task_signature()
        policy = core.policy
        if getattr(policy, "open", False):  # a round's deadline is a tick event
            deadline = getattr(policy, "deadline", math.inf)
            if deadline not in self._ticks and math.isfinite(deadline):
                self._ticks.add(deadline)
                self.queue.push(max(deadline, self.clock.now), (_TICK, -1, 0))

    def _wake(self) -> None:
        """The held long polls see a changed state: each asks the core again."""
        waiting = sorted(self.waiting)
        self.waiting.clear()
        for c in waiting:
            self._serve_task(c)

    # -- the end -------------------------------------------------------------------------

    def run(self) -> SimulationResult:
        """Run to the end (``max_versions``, ``max_time_s``, or no possible progress)."""
        self.advance()
        return self.finish()

__all__ = ["Simulation", "SimulationResult", "client_id", "plot_staleness"]
