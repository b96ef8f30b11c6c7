"""When updates become new global versions: synchronous rounds, buffered async (FedBuff), or
FedCompass's arrival groups.

Every policy sits on the same core and receives each update as soon as it has been validated
and decoded. A policy decides which clients should train (``task_for``) and when the
aggregate becomes a new version (it calls ``host.publish``). A policy sees the core only
through :class:`PolicyHost`, the few members it needs.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from murmura.aggregation import (
    AggregationError,
    Aggregator,
    FedBuff,
    StaleUpdateError,
    create_aggregator,
    staleness_function,
)
from murmura.protocols import Action, ModelSpec, Task, UpdateHeader
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
from murmura.server.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from murmura.server.config import ServerConfig
    from murmura.server.core import ClientRecord

log = logging.getLogger(__name__)
Release = Callable[[], None] | None
#: A sync cohort member is never judged silent sooner than this (seconds), whatever its speed.
LIVENESS_MIN_S = 1.0
#: Seconds per local step FedCompass plans with, at least and at most.
STEP_TIME_RANGE = (1e-6, 86_400.0)


class PolicyHost(Protocol):
    """The side of the aggregator a policy sees (the core implements it).

    Read: the run's ``config`` and ``spec``, the length of the vectors it aggregates
    (``update_size``), the ``clock``, the current ``version`` and whether the run is ``ready``,
    ``done`` or ``finished``, how many versions are being ``publishing``, and the bound on one
    version's aggregate (``fold_limit``, with the mass taken so far, ``fold_mass``, which
    FedCompass sets when it re-plans a version). Act: fold an update on the publisher
    (``fold``), make a version (``publish``), drop a silent client (``drop_client``), log an
    event, derive a seed.
    """

    config: ServerConfig
    spec: ModelSpec
    update_size: int
    clock: Callable[[], float]
    version: int
    ready: bool
    done: bool
    publishing: int
    fold_mass: float
    fold_limit: float

    @property
    def finished(self) -> bool: ...

    def derive_seed(self, *parts: object) -> int: ...

    def log_event(self, event: str, **fields: Any) -> None: ...

    def active_client_ids(self) -> list[str]: ...

    def record_of(self, client_id: str) -> ClientRecord | None: ...

    def drop_client(self, rec: ClientRecord, why: str) -> None: ...

    def fold(self, fn: Callable[..., None], decoded: Decoded, *args: Any,
             release: Callable[[], None] | None = None, **kwargs: Any) -> None: ...

    def publish(self, aggregator: Aggregator, *, updates: int, round_id: int = 0) -> None: ...


def _staleness_fn(core: PolicyHost):  # noqa: ANN202
    cfg = core.config
    params = {"a": cfg.staleness_exponent} if cfg.staleness == "polynomial" else {}
    return staleness_function(cfg.staleness, **params)


def output_layer_values(spec: ModelSpec) -> int:
    """Values of the model's output layer, last in the flat vector: its last tensor with two or
    more dimensions (the weight matrix) and every tensor after it (the bias). 0 when the
    spec has no such tensor."""
    for i in range(len(spec.tensors) - 1, -1, -1):
        if len(spec.tensors[i].shape) >= 2:
            return sum(t.numel for t in spec.tensors[i:])
    return 0


def make_aggregator(core: PolicyHost) -> Aggregator:
    """The configured rule for vectors of the core's update size."""
    cfg = core.config
    options = cfg.defense_kwargs()
    if cfg.accumulator == "exact":
        options["exact"] = True  # config validation allows it only for decomposable rules
    if cfg.defense == "default":
        options = layered_default(options, core.spec, core.update_size)
    return create_aggregator(cfg.defense, core.update_size, **options)


#: What a server gives the `default` rule when its options leave the clipping constants to it:
#: the body clipped at 1.0 robust sigmas, the output layer at 2.5. The rule itself sees a flat
#: vector and clips everything at its huber_c (1.345) unless told where the output layer is.
#: Measured per attack on the robustness benchmark (docs/robustness.md).
LAYERED_DEFAULT = {"huber_c": 1.0, "head_c": 2.5}


def layered_default(options: dict[str, Any], spec: ModelSpec, update_size: int
                    ) -> dict[str, Any]:
    """`default`'s options with the output layer filled in from the model's spec.

    Options that set none of ``huber_c``, ``head_c`` and ``head`` get :data:`LAYERED_DEFAULT`;
    ``head_c`` without ``head`` gets the output layer's size. A run whose updates are not the
    model's values (seed-pool coefficients) or a spec with no weight matrix keeps the rule's
    own single constant.
    """
    head = output_layer_values(spec) if update_size == spec.size else 0
    if head == 0 or "head" in options:
        return options
    if not {"huber_c", "head_c"} & options.keys():
        options = {**options, **LAYERED_DEFAULT}
    if "head_c" in options:
        options = {**options, "head": head}
        log.info("defense 'default': the last %d values (the output layer) are clipped at "
                 "head_c=%g", head, options["head_c"])
    return options


def fold_into(decoded: Decoded, agg: Aggregator, weight: float, *, factor: float = 1.0,
              client_id: str = "") -> None:
    """Add one decoded push to ``agg``: an update with its weight, or a leaf's partial
    aggregate (which carries its own weight) merged as a whole."""
    if decoded.is_partial:
        agg.merge(decoded.as_partial(), factor=factor)  # type: ignore[attr-defined]
    else:
        assert decoded.values is not None
        agg.add(decoded.values, weight, factor=factor, client_id=client_id)


class Policy(ABC):
    #: The rule the policy folds into; the core asks it whether partials can enter.
    aggregator: Aggregator

    def __init__(self, core: PolicyHost) -> None:
        self.core = core
        self.staleness = _staleness_fn(core)

    @abstractmethod
    def task_for(self, rec: ClientRecord) -> Task: ...

    def check_staleness(self, staleness: int) -> None:
        limit = self.core.config.max_staleness
        if staleness > limit:
            raise FailedPrecondition(
                f"update is {staleness} versions old (trained on version "
                f"{self.core.version - staleness}, global is {self.core.version}); "
                f"the limit is {limit}: pull the model and train again")

    @abstractmethod
    def accept(self, rec: ClientRecord, header: UpdateHeader, update: Decoded,
               staleness: int, release: Release = None) -> None:
        """Take a decoded update in; raise a ServiceError (changing nothing) to refuse.

        Once taken, ``release`` (if any) must be called after the update has been folded.
        """

    @abstractmethod
    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        """Take back an update that was accepted (and acknowledged) before a restart and not
        yet published: no checks, it passed them once (see server/store.py)."""

    def restore_round(self, round_id: int) -> None:  # noqa: B027 - optional hook
        """The last published version's round, so a restarted run continues the numbering."""

    def on_leave(self, rec: ClientRecord) -> None:  # noqa: B027 - optional hook
        """A client left or was dropped."""

    def forget(self, client_id: str) -> None:  # noqa: B027 - optional hook
        """A client left for good: drop what the policy keeps about it."""

    def tick(self, now: float) -> None:  # noqa: B027 - optional hook
        """Called periodically with the core's clock: enforce deadlines."""

    def buffered(self) -> int:
        """Updates taken in but not yet part of a published version."""
        return 0


class SyncPolicy(Policy):
    """Synchronous rounds: a seeded cohort trains on one version; the round closes when every
    member has answered or left, or at the deadline with whatever arrived.

    Cohort updates are folded in sorted client-id order, so a rerun gives bit-identical models
    whatever order the network delivers them in (an early update waits for its predecessors).
    Updates that arrive after their round closed are not lost: they enter the next aggregate
    with their staleness weight.

    Liveness: the policy measures each client's task time (from taking its task to pushing).
    Once a member of the round has pushed, a member silent for ``liveness_factor`` times its
    own task time (the cohort's median before its first measurement), scaled by how much
    slower than usual this round's pushers were, is taken for dead (killed, frozen, or gone
    without leaving): its session ends, so neither this round nor the next waits for it. A
    machine under load slows everyone alike and drops no one; a live client that was only
    slow joins again and its update counts, late.
    """

    def __init__(self, core: PolicyHost) -> None:
        super().__init__(core)
        self.agg = self.aggregator = make_aggregator(core)
        self._folded = 0                                # updates handed to the publisher
        self.round = 0
        self.open = False
        self.cohort: list[str] = []
        self._members: frozenset[str] = frozenset()  # the cohort, for O(1) membership
        self.submitted: set[str] = set()
        self.dropped: set[str] = set()
        self._pending: dict[str, tuple[Decoded, float, Release]] = {}
        self._next = 0
        self.deadline = math.inf
        self._issued: dict[str, float] = {}   # member -> when it took this round's task
        #: How much slower than usual this round's pushers were (at least 1; None until the
        #: round's first push): a machine under load slows every member, and none is taken
        #: for dead for being as slow as the others.
        self._slowdown: float | None = None
        #: client -> smoothed seconds from taking a task to pushing its update
        self.task_s: dict[str, float] = {}

    def _maybe_open(self) -> None:
        cfg = self.core.config
        if self.core.publishing:  # the last round's version is not out yet
            return
        ids = sorted(self.core.active_client_ids())
        if len(ids) < cfg.min_clients:
            return
        k = cfg.cohort_size or math.ceil(cfg.cohort_fraction * len(ids))
        k = max(min(k, len(ids)), 1)
        self.round += 1
        rng = np.random.default_rng([cfg.seed, self.round])
        chosen = rng.choice(len(ids), size=k, replace=False) if k < len(ids) else range(len(ids))
        self.cohort = sorted(ids[i] for i in chosen)
        self._members = frozenset(self.cohort)
        self.submitted, self.dropped, self._pending, self._next = set(), set(), {}, 0
        self._issued = {}
        self._slowdown = None
        self.deadline = self.core.clock() + cfg.round_deadline_s
        self.open = True
        self.core.log_event("round_open", round=self.round, cohort=len(self.cohort))

    def task_for(self, rec: ClientRecord) -> Task:
        if self.core.done:
            return Task(Action.STOP, version=self.core.version)
        if not self.open and self.core.ready:
            self._maybe_open()
        cid = rec.client_id
        if self.open and cid in self._members and cid not in self.submitted:
            self.dropped.discard(cid)  # a member that re-joined may still answer
            self._issued.setdefault(cid, self.core.clock())
            return Task(Action.TRAIN, version=self.core.version, round=self.round,
                        seed=self.core.derive_seed("round", self.round, cid))
        return Task(Action.WAIT, version=self.core.version, round=self.round, retry_after_s=0.5)

    def accept(self, rec: ClientRecord, header: UpdateHeader, update: Decoded,
               staleness: int, release: Release = None) -> None:
        cid = rec.client_id
        current = self.open and header.round == self.round and staleness == 0
        if current and cid not in self._members:
            raise FailedPrecondition(f"client {cid!r} is not in the cohort of round {self.round}")
        if current and cid in self.submitted:
            raise FailedPrecondition(f"client {cid!r} already sent an update for round "
                                     f"{self.round}")
        if header.round > self.round:
            raise InvalidArgument(f"round {header.round} has not started (current round is "
                                  f"{self.round})")
        weight = float(header.num_examples)
        if current:
            self.dropped.discard(cid)  # a re-joined member retrying its push
            self.submitted.add(cid)
            self._measure(cid)
            self._pending[cid] = (update, weight, release)
            self._fold_in_order()
        else:  # late: a closed or abandoned round, or an older version
            self._fold(update, weight, self.staleness(staleness), cid, release)
        self._maybe_close()

    def _fold(self, update: Decoded, weight: float, factor: float, cid: str,
              release: Release) -> None:
        self._folded += update.count
        self.core.fold(fold_into, update, self.agg, weight, factor=factor, client_id=cid,
                       release=release)

    def _fold_in_order(self, *, flush: bool = False) -> None:
        while self._next < len(self.cohort):
            cid = self.cohort[self._next]
            if cid in self._pending:
                update, weight, release = self._pending.pop(cid)
                self._fold(update, weight, 1.0, cid, release)
            elif not (flush or cid in self.dropped):
                return
            self._next += 1

    def _maybe_close(self, *, deadline: bool = False) -> None:
        if not self.open:
            return
        # submitted and dropped are disjoint subsets of the cohort
        answered = len(self.submitted) + len(self.dropped) >= len(self.cohort)
        if not (answered or deadline):
            return
        self._fold_in_order(flush=True)
        self.open = False
        if self._folded == 0:
            self.core.log_event("round_abandoned", round=self.round)
            return
        count, self._folded = self._folded, 0
        self.core.publish(self.agg, updates=count, round_id=self.round)

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        # The round it answered is gone with the old process: it enters the next round's
        # version as a late update would, with its staleness weight.
        self._fold(update, float(header.num_examples), self.staleness(staleness), client_id,
                   None)

    def restore_round(self, round_id: int) -> None:
        self.round = max(self.round, round_id)

    def on_leave(self, rec: ClientRecord) -> None:
        if self.open and rec.client_id in self._members and rec.client_id not in self.submitted:
            self.dropped.add(rec.client_id)
            self._fold_in_order()
            self._maybe_close()

    def tick(self, now: float) -> None:
        if self.open and now >= self.deadline:
            self._maybe_close(deadline=True)
        elif self.open and self.core.config.liveness_factor:
            self._drop_silent(now)

    def _measure(self, cid: str) -> None:
        taken = self._issued.pop(cid, None)
        if taken is None:
            return
        seconds = max(self.core.clock() - taken, 0.0)
        old = self.task_s.get(cid)
        ratio = seconds / old if old else 1.0
        self._slowdown = max(self._slowdown or 1.0, ratio)
        self.task_s[cid] = seconds if old is None else 0.5 * (old + seconds)

    def liveness_bound(self, cid: str, typical: float | None = None) -> float | None:
        """Seconds of silence after which cohort member ``cid`` is taken for dead (None: no
        measurement yet; the round deadline alone applies). ``typical``: the cohort's median
        task time when the caller has it (one median per tick, not one per member)."""
        expected = self.task_s.get(cid)
        if expected is None:
            expected = typical if typical is not None else self._typical_task_s()
            if expected is None:
                return None
        return max(LIVENESS_MIN_S, self.core.config.liveness_factor * expected)

    def _typical_task_s(self) -> float | None:
        return float(np.median(list(self.task_s.values()))) if self.task_s else None

    def _drop_silent(self, now: float) -> None:
        if self._slowdown is None:  # nobody has pushed this round: no scale to judge by
            return
        silent = []
        typical = self._typical_task_s()
        for cid in self.cohort:
            if cid in self.submitted or cid in self.dropped:
                continue
            rec = self.core.record_of(cid)
            bound = self.liveness_bound(cid, typical)
            if rec is None or bound is None:
                continue
            bound *= self._slowdown
            quiet = now - rec.last_seen
            if quiet > bound:
                silent.append((rec, quiet, bound))
        for rec, quiet, bound in silent:  # each ends a session, which may close the round
            self.core.drop_client(rec, f"silent for {quiet:.1f} s in round {self.round}, over "
                                       f"its liveness bound of {bound:.1f} s")

    def forget(self, cid: str) -> None:
        """A client's session ended for good: its measurements go (memory stays bounded)."""
        self.task_s.pop(cid, None)

    def buffered(self) -> int:
        return self._folded + len(self._pending)


class AsyncPolicy(Policy):
    """Buffered asynchronous aggregation: every client trains whenever it asks; each
    ``buffer_size`` updates, weighted by staleness, make one new version."""

    def __init__(self, core: PolicyHost) -> None:
        super().__init__(core)
        cfg = core.config
        self.buffer = FedBuff(core.update_size, buffer_size=cfg.buffer_size,
                              max_staleness=cfg.max_staleness, staleness=self.staleness,
                              aggregator=lambda size: make_aggregator(core))
        self.aggregator = self.buffer.aggregator
        self._tasks = 0

    def task_for(self, rec: ClientRecord) -> Task:
        if self.core.done:
            return Task(Action.STOP, version=self.core.version)
        if not self.core.ready:
            return Task(Action.WAIT, version=self.core.version, retry_after_s=0.5)
        self._tasks += 1
        return Task(Action.TRAIN, version=self.core.version,
                    seed=self.core.derive_seed("task", self._tasks, rec.client_id))

    def accept(self, rec: ClientRecord, header: UpdateHeader, update: Decoded,
               staleness: int, release: Release = None) -> None:
        try:
            self.buffer.check(staleness)
        except StaleUpdateError as exc:
            raise FailedPrecondition(str(exc)) from exc
        except AggregationError as exc:
            raise InvalidArgument(str(exc)) from exc
        self._take(rec.client_id, header, update, staleness, release)

    def _take(self, client_id: str, header: UpdateHeader, update: Decoded, staleness: int,
              release: Release) -> None:
        # FedBuff's own rules (aggregation/fedbuff.py) on this thread; the fold itself runs on
        # the publisher, after the folds before it.
        factor, full = self.buffer.admit(staleness, update.count)
        self.core.fold(fold_into, update, self.aggregator, float(header.num_examples),
                       factor=factor, client_id=client_id, release=release)
        if full:
            self.core.publish(self.aggregator, updates=self.buffer.emptied())

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        self._take(client_id, header, update, staleness, None)

    def buffered(self) -> int:
        return self.buffer.count


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
        cfg = self.core.config
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
