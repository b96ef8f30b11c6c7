"""FedCompass's policy: the arrival groups, each client's speed estimate, the held updates.

The scheduling rules are pure functions in :mod:`murmura.server.compass`; this is the state
that uses them, over the same :class:`~murmura.server.policy.PolicyHost` the other policies
see.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from murmura.protocols import Action, Task, UpdateHeader
from murmura.server.compass import (
    Assignment,
    GroupPlan,
    choose_group,
    founder_steps,
    new_group,
    plan_batch,
    refine_step_time,
    steps_for,
    version_step,
)
from murmura.server.decoding import Decoded

if TYPE_CHECKING:
    from murmura.server.core import ClientRecord

from murmura.server.policy import (
    STEP_TIME_RANGE,
    Policy,
    PolicyHost,
    Release,
    fold_into,
    make_aggregator,
)

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """An update taken in and waiting for its group's aggregate."""

    update: Decoded
    weight: float
    base_version: int
    release: Release
    mass: float


@dataclass
class _Group:
    plan: GroupPlan
    #: Clients assigned to the group (or planned into it) that have not arrived yet.
    members: set[str] = field(default_factory=set)
    arrived: dict[str, _Held] = field(default_factory=dict)
    #: Seconds per step of the fastest client ever placed in it (new groups align with its
    #: next arrival, see compass.founder_steps).
    fastest: float = math.inf

    def place(self, cid: str, step_time: float | None) -> None:
        self.members.add(cid)
        if step_time is not None:
            self.fastest = min(self.fastest, step_time)


@dataclass(frozen=True)
class _Flight:
    gid: int
    steps: int
    at: float


class CompassPolicy(Policy):
    """FedCompass: each client gets a number of local steps from its measured speed so that
    the clients of one arrival group finish together; each group becomes one version.

    Li et al., "FedCompass: Efficient Cross-Silo Federated Learning on Heterogeneous Client
    Devices Using a Computing Power-Aware Scheduler", ICLR 2024,
    https://arxiv.org/abs/2309.14675. The scheduling decisions are the pure functions of
    :mod:`murmura.server.compass`; this class keeps the state.

    * Speed: seconds per local step, first from the device profile's ``steps_per_s`` (measured
      by the client at start), then from each task's observed time (assignment to arrival,
      which includes the client's pull and push), averaged.
    * Assignment: a client joins the group that gives it the most steps within
      ``[q_min, q_max]``, or founds a group whose arrival is aligned with the next arrival of
      an open group's fastest member (the paper's Algorithm 2; ``q_max`` steps when there is
      none). The members of a group that was just aggregated are placed together, fastest
      first. A client of unknown speed gets ``q_max`` steps and no group: its update enters
      the next aggregate.
    * Aggregation: when every member has arrived, or at the group's latest arrival time with
      what has arrived, the group's updates (and any late ones) are folded with their sample
      counts times the staleness weight and published as one version. A version of ``m``
      updates moves the model ``sqrt(m / N)`` times their weighted mean (at least once; N =
      ``compass_step_updates``, by default ``buffer_size``), so a large group takes a larger
      step with the noise of N averaged updates; ``compass_step`` ``mean`` and ``linear``
      (``m / N``, the paper's fixed weight 1/N per update with N clients) are the
      alternatives (:func:`~murmura.server.compass.version_step`). Members that arrived
      wait for that version (a short wait: the group was planned to arrive together); late
      members' updates enter the next group's aggregate.
    """

    def __init__(self, core: PolicyHost) -> None:
        super().__init__(core)
        self.bounds = core.config.compass_bounds()
        self.agg = self.aggregator = make_aggregator(core)
        self.groups: dict[int, _Group] = {}
        self.observed: dict[str, float] = {}      # s/step from finished tasks
        self.flights: dict[str, _Flight] = {}
        self.planned: dict[str, Assignment] = {}  # placed at a group's close, not yet asked
        self.late: list[tuple[str, _Held]] = []
        self._wait_for: dict[str, int] = {}       # version that will hold the client's update
        self._next_gid = 1
        self._tasks = 0
        #: Groups aggregated so far (the simulator watches it to wake waiting clients).
        self.round = 0

    # -- what the transports watch ------------------------------------------------------------

    @property
    def open(self) -> bool:
        return bool(self.groups)

    @property
    def deadline(self) -> float:
        return min((g.plan.latest for g in self.groups.values()), default=math.inf)

    def buffered(self) -> int:
        return sum(len(g.arrived) for g in self.groups.values()) + len(self.late)

    # -- speeds and assignments ---------------------------------------------------------------

    def step_time(self, rec: ClientRecord) -> float | None:
        """Seconds per local step: observed, else from the profile, else unknown."""
        t = self.observed.get(rec.client_id)
        if t is None:
            sps = rec.profile.steps_per_s
            if not (sps > 0 and math.isfinite(sps)):
                return None
            t = 1.0 / sps
        # a profile is the client's claim: keep it within a microsecond and a day per step
        return min(max(t, STEP_TIME_RANGE[0]), STEP_TIME_RANGE[1])

    def _live_plans(self, now: float) -> list[GroupPlan]:
        return [g.plan for g in self.groups.values() if g.plan.arrival > now]

    def _add_group(self, plan: GroupPlan) -> _Group:
        g = self.groups[plan.gid] = _Group(plan)
        self._next_gid = max(self._next_gid, plan.gid + 1)
        return g

    def _anchors(self, now: float) -> list[tuple[float, float]]:
        """(latest arrival, fastest member's s/step) of the groups a founder aligns with."""
        return [(g.plan.latest, g.fastest) for g in self.groups.values()
                if now < g.plan.latest and math.isfinite(g.fastest)]

    def _assign(self, rec: ClientRecord, now: float, t: float | None) -> Assignment:
        cid = rec.client_id
        planned = self.planned.pop(cid, None)
        if planned is not None:
            g = self.groups.get(planned.gid)
            if g is not None:
                g.members.discard(cid)
                q = None if t is None else steps_for(g.plan.arrival, now, t, self.bounds)
                if q is not None:
                    return Assignment(planned.gid, q)
                self._maybe_close(g)
        if t is None:
            return Assignment(0, self.bounds.q_max)  # unknown speed: no group yet
        a = choose_group(self._live_plans(now), now, t, self.bounds, self._sizes())
        if a is None:
            q = founder_steps(now, t, self.bounds, self._anchors(now))
            plan = new_group(self._next_gid, now, t, self.bounds, q)
            self._add_group(plan)
            a = Assignment(plan.gid, q)
        return a

    def _sizes(self) -> dict[int, int]:
        """Members per group: those training for it and those that have arrived."""
        return {gid: len(g.members) + len(g.arrived) for gid, g in self.groups.items()}

    def _forget(self, cid: str) -> None:
        """The client's unfinished work is abandoned: it no longer counts as a member."""
        flight = self.flights.pop(cid, None)
        if flight is not None and flight.gid in self.groups:
            g = self.groups[flight.gid]
            g.members.discard(cid)
            self._maybe_close(g)
        planned = self.planned.pop(cid, None)
        if planned is not None and planned.gid in self.groups:
            g = self.groups[planned.gid]
            g.members.discard(cid)
            self._maybe_close(g)

    def task_for(self, rec: ClientRecord) -> Task:
        core = self.core
        if core.done:
            return Task(Action.STOP, version=core.version)
        if not core.ready:
            return Task(Action.WAIT, version=core.version, retry_after_s=0.5)
        cid = rec.client_id
        wait_for = self._wait_for.get(cid)
        if wait_for is not None:
            if core.publishing and wait_for > core.version:  # its group's version is coming
                return Task(Action.WAIT, version=core.version, round=self.round,
                            retry_after_s=0.2)
            del self._wait_for[cid]
        if any(cid in g.arrived for g in self.groups.values()):
            return Task(Action.WAIT, version=core.version, round=self.round, retry_after_s=0.5)
        if cid in self.flights:  # asked again without pushing: that work is lost
            self._forget(cid)
        now = core.clock()
        t = self.step_time(rec)
        a = self._assign(rec, now, t)
        if a.gid in self.groups:
            self.groups[a.gid].place(cid, t)
        self.flights[cid] = _Flight(a.gid, a.steps, now)
        self._tasks += 1
        return Task(Action.TRAIN, version=core.version, round=a.gid,
                    seed=core.derive_seed("compass", self._tasks, cid), local_steps=a.steps)

    # -- updates and groups -------------------------------------------------------------------

    def accept(self, rec: ClientRecord, header: UpdateHeader, update: Decoded,
               staleness: int, release: Release = None) -> None:
        cid = rec.client_id
        weight = float(header.num_examples)
        held = _Held(update, weight, header.base_version, release,
                     update.max_abs * (1.0 if update.is_partial else weight))
        now = self.core.clock()
        flight = self.flights.pop(cid, None)
        if flight is not None:
            refined = refine_step_time(self.observed.get(cid), now - flight.at, flight.steps)
            if refined is not None:
                self.observed[cid] = refined
        g = self.groups.get(flight.gid) if flight is not None else None
        if g is not None and cid in g.members:
            g.members.discard(cid)
            g.arrived[cid] = held
            self._maybe_close(g)
        else:  # late, or of unknown speed: into the next aggregate
            self.late.append((cid, held))
            if not self.groups:
                self._publish([], None)

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        # Its group is gone with the old process: it enters the next group's aggregate as a
        # late update does (staleness-weighted there).
        weight = float(header.num_examples)
        self.late.append((client_id, _Held(update, weight, header.base_version, None,
                                           update.max_abs * (1.0 if update.is_partial
                                                             else weight))))

    def _maybe_close(self, g: _Group) -> None:
        if not g.members and g.plan.gid in self.groups:
            if g.arrived:
                self._close(g)
            else:
                del self.groups[g.plan.gid]

    def _close(self, g: _Group) -> None:
        del self.groups[g.plan.gid]
        members = sorted(g.arrived)
        self._publish(sorted(g.arrived.items()), g.plan.gid)
        # the members wait for the version with their updates, then train on it
        target = self.core.version + self.core.publishing
        for cid in members:
            self._wait_for[cid] = target
        now = self.core.clock()
        times = {cid: t for cid in members
                 if (t := self.observed.get(cid)) is not None}
        open_groups = [g for g in self.groups.values() if now < g.plan.latest]
        planned, created = plan_batch(
            times, now, self._live_plans(now), self.bounds, next_gid=self._next_gid,
            sizes=self._sizes(),
            fastest={g.plan.gid: g.fastest for g in open_groups if math.isfinite(g.fastest)})
        for plan in created:
            self._add_group(plan)
        for cid, a in planned.items():
            self.planned[cid] = a
            self.groups[a.gid].place(cid, times[cid])

    def _publish(self, items: list[tuple[str, _Held]], gid: int | None) -> None:
        """Fold a group's updates and the late ones, weighted by staleness; publish."""
        items = items + self.late
        self.late = []
        if not items:
            return
        if self.core.finished:  # the last version is out or being made: nothing more to add
            for _, h in items:
                if h.release is not None:
                    h.release()
            return
        version = self.core.version
        count = sum(h.update.count for _, h in items)
        scale = self._step_scale(count, sum(h.mass for _, h in items))
        for cid, h in items:
            self.core.fold(fold_into, h.update, self.agg, h.weight,
                           factor=scale * self.staleness(max(version - h.base_version, 0)),
                           client_id=cid, release=h.release)
        self.core.publish(self.agg, updates=count, round_id=gid or 0)
        # updates held for other groups go into later aggregates: keep their mass counted
        self.core.fold_mass = sum(h.mass for grp in self.groups.values()
                                  for h in grp.arrived.values())
        self.round += 1

    def _step_scale(self, count: int, mass: float) -> float:
        """How far a version of ``count`` updates moves the model, in weighted means of them
        (:func:`murmura.server.compass.version_step` under ``compass_step``). Kept below what
        the accumulator can hold for this version's updates (``mass``: their largest |value|
        x weight, summed)."""
        cfg = self.core.config.policy
        scale = version_step(max(count, 1), cfg.compass_step, cfg.compass_reference)
        if scale * mass > self.core.fold_limit:
            scale = self.core.fold_limit / mass
        return scale

    def on_leave(self, rec: ClientRecord) -> None:
        self._wait_for.pop(rec.client_id, None)
        self._forget(rec.client_id)

    def tick(self, now: float) -> None:
        for g in [g for g in self.groups.values() if now >= g.plan.latest]:
            if g.plan.gid not in self.groups:
                continue
            if g.arrived:
                self._close(g)  # with what has arrived; the rest will be late
            else:
                del self.groups[g.plan.gid]
        if self.late and not self.groups:
            self._publish([], None)


__all__ = ["CompassPolicy"]
