"""When updates become new global versions: synchronous rounds or buffered async (FedBuff).

Both policies sit on the same core and receive each update as soon as it has been validated
and decoded. A policy decides which clients should train (``task_for``) and when the
aggregate becomes a new version (it calls ``core.apply``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from murmura.aggregation import (
    AggregationError,
    Aggregator,
    FedBuff,
    StaleUpdateError,
    create_aggregator,
    staleness_function,
)
from murmura.protocols import Action, Task, UpdateHeader
from murmura.server.decoding import Decoded
from murmura.server.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from murmura.server.core import AggregatorCore, ClientRecord

Release = Callable[[], None] | None


def _staleness_fn(core: AggregatorCore):  # noqa: ANN202
    cfg = core.config
    params = {"a": cfg.staleness_exponent} if cfg.staleness == "polynomial" else {}
    return staleness_function(cfg.staleness, **params)


def make_aggregator(core: AggregatorCore) -> Aggregator:
    """The configured rule for vectors of the core's update size."""
    cfg = core.config
    options = cfg.defense_kwargs()
    if cfg.accumulator == "exact":
        options["exact"] = True  # config validation allows it only for decomposable rules
    return create_aggregator(cfg.defense, core.update_size, **options)


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

    def __init__(self, core: AggregatorCore) -> None:
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
    """

    def __init__(self, core: AggregatorCore) -> None:
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

    def buffered(self) -> int:
        return self._folded + len(self._pending)


class AsyncPolicy(Policy):
    """Buffered asynchronous aggregation: every client trains whenever it asks; each
    ``buffer_size`` updates, weighted by staleness, make one new version."""

    def __init__(self, core: AggregatorCore) -> None:
        super().__init__(core)
        cfg = core.config
        self.buffer = FedBuff(core.update_size, buffer_size=cfg.buffer_size,
                              max_staleness=cfg.max_staleness, staleness=self.staleness,
                              aggregator=lambda size: make_aggregator(core))
        self.aggregator = self.buffer.aggregator
        self._count = 0  # updates handed to the publisher since the last version
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
        self._count += update.count
        self.core.fold(fold_into, update, self.aggregator, float(header.num_examples),
                       factor=self.staleness(staleness), client_id=client_id,
                       release=release)
        if self._count >= self.buffer.buffer_size:
            count, self._count = self._count, 0
            self.core.publish(self.aggregator, updates=count)

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        self._take(client_id, header, update, staleness, None)

    def buffered(self) -> int:
        return self._count
