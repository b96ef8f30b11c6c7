"""The virtual clients' events: what each client does when one of its events comes due.

Each handler is one step of :class:`~murmura.client.ClientRuntime`'s loop (come online or go
offline, join, ask for a task, pull the model, finish training, push), calling what the
client's transport calls on the core, and scheduling the client's next event on the virtual
clock; refusals take the runtime's rules (:func:`~murmura.client.rules.after_refusal`, the
retry policy's backoff). The engine (:mod:`.engine`) owns the clock, the queue and the loop
that dispatches the events (mixed into :class:`~murmura.simulation.engine.Simulation`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from murmura.client import jitter_rng
from murmura.client.rules import after_refusal
from murmura.protocols import Action, DeviceProfile, FlatVector, UpdateHeader
from murmura.server import ServiceError
from murmura.simulation.wire import update_wire_bytes

log = logging.getLogger(__name__)

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
    payload: bytes | memoryview | None = None  # memoryview: a dense-f32 delta's own bytes
    codec: str = ""                       # "" : the run's codec (settings.codec)
    num_examples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    header: UpdateHeader | None = None
    wire: int = 0


class ClientEventsJob:
    """The virtual clients' event handlers (mixed into the engine)."""

    #: counters these handlers move (the engine declares and reports them)
    lost: int
    gave_up: int

    if TYPE_CHECKING:  # the engine's state, typed where Simulation declares it
        def __getattr__(self, name: str) -> Any: ...

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
