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
import logging
import math
import random
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from murmura.client import Backoff, RetryPolicy, jitter_rng
from murmura.client.malicious import Attack
from murmura.client.rules import UpdateIds, after_refusal, codec_choice, make_encoder
from murmura.protocols import (
    Action,
    DeviceProfile,
    Encoder,
    FlatVector,
    ModelSpec,
    TaskSettings,
    UpdateHeader,
    create_codec,
)
from murmura.server import AggregatorCore, ServerConfig, ServiceError, build_core
from murmura.server.secagg_policy import SecAggAsyncPolicy, SecAggPolicy
from murmura.simulation.attacks import BatchHook, check_attacks, poison_data
from murmura.simulation.clock import EventQueue, VirtualClock
from murmura.simulation.config import SimulationConfig
from murmura.simulation.data import SimulationData, load_simulation_data
from murmura.simulation.execution import Executor, default_workers
from murmura.simulation.population import availability, choose_executor, device_population
from murmura.simulation.results import ResultsJob, SimulationResult, plot_staleness
from murmura.simulation.secagg import SecAggDriver
from murmura.simulation.updates import UpdatesJob, split_for_client_eval
from murmura.simulation.wire import ModelWire, update_wire_bytes
from murmura.tasks import TaskConfig

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.npz"
#: Codecs whose encoders keep no state: one encoder serves every client.
STATELESS_CODECS = frozenset({"dense-f32", "dense-f16"})


# event kinds
_ONLINE, _OFFLINE, _JOIN, _TASK, _PULL, _DONE, _PUSH, _TICK = range(8)
# events after which the core's state is as it was (a pull only reads the model)
_LOCAL = frozenset((_ONLINE, _PULL, _DONE))


@dataclass(slots=True)
class _Flight:
    """A client's task in progress: from its TRAIN answer to its push."""

    round: int
    seed: int
    steps: int = 0                        # the server's assignment; 0: the settings' own
    version: int = -1
    params: FlatVector | None = None      # the global vector it trains from (shared)
    payload: bytes | None = None
    codec: str = ""                       # "" : the run's codec (settings.codec)
    num_examples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    header: UpdateHeader | None = None
    wire: int = 0


def client_id(index: int) -> str:
    """The id ``murmura run`` gives client ``index`` (so sorted cohorts agree)."""
    return f"client-{index:03d}"


class Simulation(UpdatesJob, ResultsJob):
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
        self.out_dir = Path(sim.out) if out_dir is True else (Path(out_dir) if out_dir else None)
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
        return build_core(config, self.task_config, out_dir=self.out_dir,
                          evaluate=evaluate, task=self.data.task, clock=self.clock,
                          checkpoint=self.sim.checkpoint, fresh_metrics=True,
                          extra_config={"simulation": dataclasses.asdict(self.sim),
                                        "data": self.data.source})

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
        self._sig = self._signature()

    def advance(self, until_s: float = math.inf) -> bool:
        """Process events up to virtual time ``until_s``; False once the run is over."""
        threads = self.sim.threads or default_workers()
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
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

    def _signature(self) -> tuple[Any, ...]:
        core, policy = self.core, self.core.policy
        is_open = getattr(policy, "open", None)
        return (core.version, core.done, getattr(policy, "round", 0), is_open,
                len(core.sessions) if not is_open else -1)

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
        sig = self._signature()
        if sig != self._sig:
            self._sig = sig
            if self.waiting:
                self._wake()
                self._sig = self._signature()
        deadline = getattr(core.policy, "deadline", math.inf)
        if getattr(core.policy, "open", False) and math.isfinite(deadline) \
                and deadline not in self._ticks:
            self._ticks.add(deadline)
            self.queue.push(max(deadline, self.clock.now), (_TICK, -1, 0))

    def _wake(self) -> None:
        """The held long polls see a changed state: each asks the core again."""
        waiting = sorted(self.waiting)
        self.waiting.clear()
        for c in waiting:
            self._serve_task(c)

    # -- client events -------------------------------------------------------------------

    def _lat(self, c: int) -> float:
        return self._latency[c]

    def _on_online(self, c: int) -> None:
        self.online[c] = 1
        t = self.availability.next_transition(c, self.clock.now, True)
        if math.isfinite(t):
            self._schedule(t, _OFFLINE, c)
        self._schedule(self.clock.now + self._lat(c), _JOIN, c)

    def _on_offline(self, c: int) -> None:
        self.online[c] = 0
        self.gen[c] += 1  # every event already scheduled for this client is void
        if self.flights.pop(c, None) is not None:
            self.lost += 1
        self.waiting.pop(c, None)
        if self._resume or self._retrying:
            self._resume.pop(c, None)
            self._retrying.pop(c, None)
        if self.sim.dropout == "leave" and self.sessions[c]:
            try:
                self.core.leave(self.sessions[c])
            except ServiceError:
                pass
            self.sessions[c] = ""
        t = self.availability.next_transition(c, self.clock.now, False)
        if math.isfinite(t):
            self._schedule(t, _ONLINE, c)

    def _on_join(self, c: int) -> None:
        profile = DeviceProfile(device="cpu", device_name="simulated",
                                steps_per_s=1.0 / float(self.devices.step_time_s[c]))
        try:
            result = self.core.join(self.ids[c], profile)
        except ServiceError as exc:
            self._refused(c, exc, _JOIN)
            return
        self.sessions[c] = result.session
        then = _TASK
        if self._resume or self._retrying:
            self._retrying.pop(c, None)
            then = self._resume.pop(c, _TASK)  # the request the lost session interrupted
            flight = self.flights.get(c)
            if then == _PUSH and flight is not None and flight.header is not None:
                flight.header = dataclasses.replace(flight.header, session=result.session)
                flight.wire = update_wire_bytes(flight.header)
        self._schedule(self.clock.now + 2 * self._lat(c), then, c)

    def _on_task(self, c: int) -> None:
        self._serve_task(c)

    def _serve_task(self, c: int) -> None:
        try:
            task = self.core.task(self.sessions[c])
        except ServiceError as exc:
            self._refused(c, exc, _TASK)
            return
        if self._retrying:
            self._retrying.pop(c, None)
        if task.action == Action.TRAIN:
            self.flights[c] = _Flight(round=task.round, seed=task.seed, steps=task.local_steps)
            self._schedule(self.clock.now + 2 * self._lat(c), _PULL, c)
        elif task.action == Action.WAIT:
            self.waiting[c] = None
        elif self.sessions[c]:  # STOP: the client leaves
            try:
                self.core.leave(self.sessions[c])
            except ServiceError:
                pass
            self.sessions[c] = ""

    def _refused(self, c: int, exc: ServiceError, kind: int) -> None:
        """The core refused client ``c``'s request ``kind``: do what the runtime does."""
        self.refused[exc.status] += 1
        action = after_refusal(exc.status, exc.retry_after_s)
        now = self.clock.now
        if action == "retry":
            backoff = self._retrying.get(c)
            if backoff is None:
                rng = self._jitter.get(c)
                if rng is None:  # as the deployed client of this id draws its jitter
                    rng = self._jitter[c] = jitter_rng(self.ids[c])
                backoff = self._retrying[c] = self.retry.start(now, rng)
            pause = backoff.next_pause(now, exc.retry_after_s)
            if pause is not None:
                self._schedule(now + pause, kind, c)  # the same request again
                return
        elif action == "rejoin" and kind != _JOIN and self.sessions[c]:
            self.sessions[c] = ""
            self._resume[c] = kind
            self._schedule(now + self._lat(c), _JOIN, c)
            return
        elif action == "next_task" and kind != _JOIN:
            self.flights.pop(c, None)
            self._schedule(now + 2 * self._lat(c), _TASK, c)
            return
        # the runtime raises here and the client stops: it could not join, or gave up retrying
        self._give_up(c, exc)

    def _give_up(self, c: int, exc: ServiceError) -> None:
        log.warning("%s stops: %s", self.ids[c], exc)
        self.gave_up += 1
        self.flights.pop(c, None)
        self._retrying.pop(c, None)
        self._resume.pop(c, None)
        if self.sessions[c]:
            try:
                self.core.leave(self.sessions[c])
            except ServiceError:
                pass
            self.sessions[c] = ""

    def _on_pull(self, c: int) -> None:
        flight = self.flights[c]
        try:
            version, params = self.core.model(self.sessions[c])
        except ServiceError as exc:
            self._refused(c, exc, _PULL)
            return
        if self._retrying:
            self._retrying.pop(c, None)
        nbytes = self.model_wire(version)
        self.core.add_download(nbytes)
        flight.version, flight.params = version, params
        self._pending.append(c)
        t = self.clock.now + self._latency[c] + nbytes / self._down[c] + \
            self._compute_time(c, flight)
        self._schedule(t, _DONE, c)

    def _on_done(self, c: int) -> None:
        flight = self.flights[c]
        if flight.payload is None:
            self._train_pending()
        assert flight.payload is not None
        flight.header = UpdateHeader(
            session=self.sessions[c], update_id=self._update_ids(),  # kept by retries
            base_version=flight.version, round=flight.round,
            num_examples=flight.num_examples,
            codec=(flight.codec or self._codec_of.get(c) or self._client_codec
                   or self.settings.codec),
            payload_bytes=len(flight.payload), metrics=flight.metrics,
            spec_fingerprint=self.core.fingerprint)
        flight.wire = update_wire_bytes(flight.header)
        t = self.clock.now + self._latency[c] + flight.wire / self._up[c]
        self._schedule(t, _PUSH, c)

    def _on_push(self, c: int) -> None:
        flight = self.flights[c]
        assert flight.header is not None and flight.payload is not None
        if self.secagg is not None:
            self._on_masked_push(c, flight)
            return
        try:
            # the push pipeline's steps, as the servicer runs them with the in-process tier
            result = self.core.pipeline.push(flight.header, flight.payload,
                                             wire_bytes=flight.wire)
        except ServiceError as exc:
            self._refused(c, exc, _PUSH)  # a retry or a re-join keeps the flight
            return
        del self.flights[c]
        if c in self._auto and not result.duplicate:
            self._choose_codec(c, flight)
        if self._retrying:
            self._retrying.pop(c, None)
        if not result.duplicate:
            self.staleness[result.staleness] += 1
        self._schedule(self.clock.now + 2 * self._lat(c), _TASK, c)

    def _on_masked_push(self, c: int, flight: _Flight) -> None:
        """Secure aggregation: the trained update enters the round as the client's key
        advert; once the cohort's adverts are in, the other steps are played among the
        members still online (simulation/secagg.py)."""
        assert self.secagg is not None and flight.payload is not None
        update = np.frombuffer(flight.payload, dtype="<f4")
        try:
            rec = self.core.client_for(self.sessions[c])
            self.secagg.take(rec, flight.round, update, max(flight.num_examples, 1))
        except ServiceError as exc:
            self._refused(c, exc, _PUSH)
            return
        del self.flights[c]
        self._pump_secagg()
        self._schedule(self.clock.now + 2 * self._lat(c), _TASK, c)

    def _pump_secagg(self) -> None:
        if self.secagg is not None and self.secagg.members:
            index = self._secagg_index
            self.secagg.pump(lambda cid: bool(self.online[index[cid]]))

    # -- the end -------------------------------------------------------------------------

    def run(self) -> SimulationResult:
        """Run to the end (``max_versions``, ``max_time_s``, or no possible progress)."""
        self.advance()
        return self.finish()

__all__ = ["Simulation", "SimulationResult", "client_id", "plot_staleness"]
