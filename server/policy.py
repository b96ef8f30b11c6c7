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
from collections import Counter
from collections.abc import Callable
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
from murmura.server.decoding import Decoded
from murmura.server.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from murmura.server.config import ServerConfig
    from murmura.server.core import ClientRecord
    from murmura.server.publisher import Publisher

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
    event, derive a seed. Secure aggregation's policies also run their model-sized steps on the
    ``publisher`` and hand results back to the owner's thread with ``post``.
    """

    config: ServerConfig
    publisher: Publisher
    post: Callable[[Callable[[], object]], object]
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

    def publish(self, aggregator: Aggregator, *, updates: int, round_id: int = 0,
                detail: dict[str, Any] | None = None) -> None: ...


def _staleness_fn(core: PolicyHost):  # noqa: ANN202
    cfg = core.config.policy
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
    cfg = core.config.policy
    options = cfg.defense_kwargs()
    if cfg.accumulator == "exact":
        options["exact"] = True  # config validation allows it only for decomposable rules
    if cfg.defense == "default":
        options = layered_default(options, core.spec, core.update_size)
    rule = create_aggregator(cfg.defense, core.update_size, **options)
    privacy = getattr(core, "privacy", None)  # DP: clip and noise around it (privacy.py)
    return privacy.wrap(rule) if privacy is not None else rule


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


def buffer_detail(staleness: list[int], clients: Counter[str]) -> dict[str, Any]:
    """An async version's buffer for its metrics row: how stale its updates were and how many
    clients they came from (a buffer filled by few clients moves the model toward their data,
    one cause of accuracy that swings from version to version with non-IID clients)."""
    if not staleness:
        return {}
    return {"staleness_mean": round(sum(staleness) / len(staleness), 3),
            "staleness_max": max(staleness),
            "buffer_clients": len(clients),
            "buffer_top_share": round(max(clients.values()) / sum(clients.values()), 3)}


class Policy(ABC):
    #: The rule the policy folds into; the core asks it whether partials can enter.
    aggregator: Aggregator

    def __init__(self, core: PolicyHost) -> None:
        self.core = core
        self.staleness = _staleness_fn(core)

    @abstractmethod
    def task_for(self, rec: ClientRecord) -> Task: ...

    def check_staleness(self, staleness: int) -> None:
        limit = self.core.config.policy.max_staleness
        if staleness > limit:
            raise FailedPrecondition(
                f"update is {staleness} versions old (trained on version "
                f"{self.core.version - staleness}, global is {self.core.version}); "
                f"the limit is {limit}: pull the model and train again", reason="too stale")

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
        cfg = self.core.config.policy
        if self.core.publishing:  # the last round's version is not out yet
            return
        ids = sorted(self.core.active_client_ids())
        if len(ids) < cfg.min_clients:
            return
        k = cfg.cohort_size or math.ceil(cfg.cohort_fraction * len(ids))
        k = max(min(k, len(ids)), 1)
        self.round += 1
        rng = np.random.default_rng([self.core.config.seed, self.round])
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
            raise FailedPrecondition(f"client {cid!r} is not in the cohort of round {self.round}",
                                     reason="not in the round's cohort")
        if current and cid in self.submitted:
            raise FailedPrecondition(f"client {cid!r} already sent an update for round "
                                     f"{self.round}", reason="already sent this round")
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
        elif self.open and self.core.config.policy.liveness_factor:
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
        return max(LIVENESS_MIN_S, self.core.config.policy.liveness_factor * expected)

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
        cfg = core.config.policy
        self.buffer = FedBuff(core.update_size, buffer_size=cfg.buffer_size,
                              max_staleness=cfg.max_staleness, staleness=self.staleness,
                              aggregator=lambda size: make_aggregator(core))
        self.aggregator = self.buffer.aggregator
        self._tasks = 0
        # the buffer being filled: each update's staleness and client (for the metrics row)
        self._stale: list[int] = []
        self._from: Counter[str] = Counter()

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
        self._stale.append(staleness)
        self._from[client_id] += 1
        if full:
            detail = buffer_detail(self._stale, self._from)
            self._stale, self._from = [], Counter()
            self.core.publish(self.aggregator, updates=self.buffer.emptied(), detail=detail)

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        self._take(client_id, header, update, staleness, None)

    def buffered(self) -> int:
        return self.buffer.count
