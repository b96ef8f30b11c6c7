"""Policies under secure aggregation: a masked group's sum becomes a version.

:class:`SecAggPolicy` is :class:`~murmura.server.policy.SyncPolicy` (same seeded cohort, same
round numbers) with the round's updates taken through a
:class:`~murmura.server.secagg.SecAggRound` instead of Push: a member gets TRAIN until it
advertises its keys, then WAIT until the round ends.

:class:`SecAggAsyncPolicy` is buffered async (FedBuff) with each buffer of ``buffer_size``
updates as one masked group: the first ``buffer_size`` clients to ask for a task form group
``g`` (its number travels as the task's round), train on whatever version is current, and run
the protocol together; the next clients form group ``g + 1`` meanwhile, so groups overlap and
nobody waits for a round. Staleness still counts: when a group reaches its masked input, the
server gives each member its staleness factor (the server knows every member's base version,
so it learns nothing new), and the member scales its weighted update by it before masking;
members past ``max_staleness`` are taken out of the group, as FedBuff would refuse them.

In both, adding masked inputs and unmasking (mask expansion, decoding) run on the publisher
thread; the unmasked weighted mean enters a FedAvg rule as one contribution carrying the
group's total weight, and the version goes through the normal publish path (optimizer step,
evaluation, metrics row, checkpoint). A group that cannot be unmasked (too many dropouts,
inconsistent shares) is abandoned: no version is made from it, and the log says why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from murmura.aggregation import Aggregator
from murmura.aggregation.dp import DPMean
from murmura.protocols import Action, Task, UpdateHeader
from murmura.protocols.secagg import RoundAbandoned
from murmura.protocols.secagg.weighted import SecAggParams
from murmura.server.decoding import Decoded
from murmura.server.errors import FailedPrecondition
from murmura.server.policy import AsyncPolicy, PolicyHost, Release, SyncPolicy, make_aggregator
from murmura.server.secagg import AdvertisedKeys, ClientView, SecAggRound, Stage, UnmaskResult

if TYPE_CHECKING:
    from murmura.server.core import ClientRecord

log = logging.getLogger(__name__)


class _SecAggSteps:
    """The protocol's steps, shared by the sync and the async policy (the servicer and the
    simulator call these). A subclass finds the round an RPC names (:meth:`_round`) and moves
    it on after each step (:meth:`_progress`)."""

    core: PolicyHost
    params: SecAggParams
    abandoned: int

    def _setup(self, core: PolicyHost) -> None:
        privacy = core.config.privacy
        params = privacy.secagg_params()
        assert params is not None
        self.params = params
        self.dropout = privacy.secagg_dropout
        self.step_timeout_s = privacy.secagg_step_timeout_s
        #: Rounds (groups) abandoned so far (tests and the log read it).
        self.abandoned = 0

    def _round(self, rec: ClientRecord, round_id: int) -> SecAggRound:
        raise NotImplementedError

    def _plan_inputs(self, sa: SecAggRound) -> None:
        """Distributed DP: the fewest inputs the round may be unmasked with, so that the
        clients' noise shares add up to at least the planned noise (the graph is sized for
        the same dropout share)."""
        if self.params.distributed_dp:
            sa.min_inputs = max(2, math.ceil((1.0 - self.dropout) * len(sa.cohort) - 1e-9))

    def _progress(self, sa: SecAggRound) -> None:
        raise NotImplementedError

    def _graph_seed(self, round_id: int) -> bytes:
        return self.core.derive_seed("secagg-graph", round_id).to_bytes(8, "little") * 4

    def _identities(self, cohort: list[str]) -> dict[str, bytes] | None:
        if not self.core.config.security.require_identity:
            return None
        return {cid: self._identity(cid) for cid in cohort}

    def _identity(self, cid: str) -> bytes:
        rec = self.core.record_of(cid)
        return rec.public_key if rec is not None and rec.public_key else b""

    #: Bumped at every protocol change a waiting client may care about (a stage, a group
    #: ending): part of the core's task signature, so a held GetTask poll re-asks then.
    task_epoch = 0

    def _changed(self) -> None:
        self.task_epoch += 1
        notify = getattr(self.core, "_changed", None)
        if notify is not None:
            notify()

    def _unmask(self, sa: SecAggRound, agg: Aggregator,
                done: Callable[[SecAggRound, UnmaskResult | None, str], None]) -> bool:
        """Rebuild the seeds here (small), then unmask on the publisher and hand the mean to
        ``agg``; ``done(sa, result or None, reason)`` runs back on the owner's thread. False
        (the round abandoned) when some secret cannot be rebuilt."""
        try:
            job = sa.unmask_job()
        except RoundAbandoned as exc:
            sa.abandon(str(exc))
            return False
        publisher = self.core.publisher
        post: Callable[[Callable[[], object]], object] = self.core.post

        def add() -> UnmaskResult:
            result = job()
            if isinstance(agg, DPMean):  # distributed DP: the clients' noised sum, as it is
                agg.add_noised_sum(result.total, result.count)
            else:
                agg.add(result.mean, result.weight)
            return result

        def finished(fut: Future[UnmaskResult]) -> None:
            exc = fut.exception()
            if exc is not None:
                sa.finish(None, f"unmasking failed: {exc}")
                done(sa, None, sa.reason)
            else:
                sa.finish(fut.result())
                done(sa, fut.result(), "")

        fut: Future[UnmaskResult] = publisher.submit(add)
        fut.add_done_callback(lambda f: post(lambda: finished(f)))
        return True

    def _publish(self, sa: SecAggRound, agg: Aggregator, result: UnmaskResult,
                 detail: dict[str, Any]) -> None:
        traffic = getattr(self.core, "traffic", None)
        if traffic is not None:  # each included masked input is one update taken in
            traffic.updates += result.count
        detail = {"secagg_clients": result.count,
                  "secagg_dropped": len(sa.cohort) - result.count, **detail}
        self.core.publish(agg, updates=result.count, round_id=sa.round_id, detail=detail)
        self._changed()

    def _abandoned(self, sa: SecAggRound) -> None:
        self.abandoned += 1
        self.core.log_event("round_abandoned", round=sa.round_id, reason=sa.reason)
        log.warning("secure-aggregation round %d abandoned, no version made from it: %s",
                    sa.round_id, sa.reason)
        self._changed()

    # -- the steps ----------------------------------------------------------------------------

    def advertise(self, rec: ClientRecord, round_id: int, keys: AdvertisedKeys) -> None:
        sa = self._round(rec, round_id)
        sa.advertise(rec.client_id, keys)
        self._progress(sa)

    def share(self, rec: ClientRecord, round_id: int, envelopes: dict[int, bytes]) -> None:
        sa = self._round(rec, round_id)
        sa.share(rec.client_id, envelopes)
        self._progress(sa)

    def begin_input(self, rec: ClientRecord, header: UpdateHeader) -> tuple[SecAggRound, int]:
        sa = self._round(rec, header.round)
        return sa, sa.begin_input(rec.client_id, header.payload_bytes, header.codec)

    def end_input(self, sa: SecAggRound, index: int, ok: bool) -> None:
        sa.end_input(index, ok)
        self._progress(sa)

    def respond(self, rec: ClientRecord, round_id: int,
                shares: dict[tuple[int, str], int]) -> None:
        sa = self._round(rec, round_id)
        sa.respond(rec.client_id, shares)
        self._progress(sa)

    def view(self, rec: ClientRecord, round_id: int) -> ClientView:
        return self._round(rec, round_id).view(rec.client_id)

    def secagg_round(self, round_id: int) -> SecAggRound | None:
        """The round (group) with this number, if it is still known."""
        raise NotImplementedError


class SecAggPolicy(_SecAggSteps, SyncPolicy):
    """Synchronous rounds whose aggregate the server only ever sees as a masked sum."""

    def __init__(self, core: PolicyHost) -> None:
        super().__init__(core)
        self._setup(core)
        self.secagg: SecAggRound | None = None
        self._stage_deadline = float("inf")
        self._unmasking = False

    # -- rounds -------------------------------------------------------------------------------

    def _maybe_open(self) -> None:
        if self._unmasking:
            return
        super()._maybe_open()
        if not self.open:  # type: ignore[has-type]  # SyncPolicy sets it untyped
            return
        if len(self.cohort) < 2:
            self.open = False  # one client's "sum" is its update: never a round
            self.round -= 1
            return
        self.secagg = SecAggRound(self.round, self.cohort, size=self.core.update_size,
                                  params=self.params, dropout_fraction=self.dropout,
                                  graph_seed=self._graph_seed(self.round),
                                  identities=self._identities(self.cohort))
        self._plan_inputs(self.secagg)
        self._stage_deadline = self.deadline  # training happens before the keys step

    def task_for(self, rec: ClientRecord) -> Task:
        if self.core.done:
            return Task(Action.STOP, version=self.core.version)
        if not self.open and self.core.ready:
            self._maybe_open()
        cid = rec.client_id
        sa = self.secagg
        if (self.open and sa is not None and sa.stage == Stage.KEYS and cid in self._members
                and cid not in sa.keys):
            self._issued.setdefault(cid, self.core.clock())
            return Task(Action.TRAIN, version=self.core.version, round=self.round,
                        seed=self.core.derive_seed("round", self.round, cid))
        return Task(Action.WAIT, version=self.core.version, round=self.round, retry_after_s=0.5)

    def accept(self, rec: ClientRecord, header: UpdateHeader, update: Decoded,
               staleness: int, release: Release = None) -> None:
        raise _push_refused()

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        raise RuntimeError("secure aggregation keeps no acknowledged plaintext updates")

    def on_leave(self, rec: ClientRecord) -> None:
        if self.secagg is not None and self.open:
            self.secagg.leave(rec.client_id)
            self._progress(self.secagg)

    def tick(self, now: float) -> None:
        sa = self.secagg
        if not self.open or sa is None or self._unmasking:
            return
        if now >= self._stage_deadline:
            log.info("secure-aggregation round %d: stage %s timed out waiting for %d client(s)",
                     self.round, sa.stage.name, len(sa.expected()))
            sa.expire()
            self._stage_deadline = self.core.clock() + self.step_timeout_s
            self._changed()
            self._progress(sa)

    def buffered(self) -> int:
        return len(self.secagg.inputs) if self.secagg is not None and self.open else 0

    def _progress(self, sa: SecAggRound) -> None:
        """Close every complete stage; start unmasking, or end an abandoned round."""
        if not self._current(sa) or not self.open or self._unmasking:
            return
        moved = False
        while sa.advance():
            self._stage_deadline = self.core.clock() + self.step_timeout_s
            moved = True
        if moved:
            self._changed()  # wake the clients' polls: their next step can start
        if sa.stage == Stage.UNMASK and not sa.expected():
            self._unmasking = True  # before: an inline publisher finishes within _unmask
            if not self._unmask(sa, self.agg, self._done):
                self._unmasking = False
        if sa.stage == Stage.ABANDONED:
            self._done(sa, None, sa.reason)

    def _current(self, sa: SecAggRound) -> bool:
        return self.secagg is not None and sa.round_id == self.secagg.round_id \
            and sa is self.secagg

    def _done(self, sa: SecAggRound, result: UnmaskResult | None, reason: str) -> None:
        self._unmasking = False
        self.open = False
        if result is None:
            self._abandoned(sa)
        else:
            self._publish(sa, self.agg, result, {})

    def _round(self, rec: ClientRecord, round_id: int) -> SecAggRound:
        sa = self.secagg
        if sa is None or round_id != sa.round_id:
            current = sa.round_id if sa is not None else 0
            raise FailedPrecondition(f"secure-aggregation round {round_id} is not the current "
                                     f"one ({current})", reason="secagg round not current")
        return sa

    def secagg_round(self, round_id: int) -> SecAggRound | None:
        sa = self.secagg
        return sa if sa is not None and sa.round_id == round_id else None


class _Group:
    """An async group: its round, each member's base version, its deadline."""

    def __init__(self, sa: SecAggRound, deadline: float) -> None:
        self.sa = sa
        self.base: dict[str, int] = {}
        self.deadline = deadline
        self.unmasking = False


#: Finished groups kept so that their members' last poll still finds them.
_KEEP_FINISHED = 8


class SecAggAsyncPolicy(_SecAggSteps, AsyncPolicy):
    """FedBuff whose buffers are masked groups of ``buffer_size`` clients."""

    def __init__(self, core: PolicyHost) -> None:
        super().__init__(core)
        self._setup(core)
        self.groups: dict[int, _Group] = {}
        self._forming: _Group | None = None
        self._next_group = 0
        self._member_of: dict[str, int] = {}  # client -> its unfinished group
        self._done_groups: list[int] = []
        #: One rule for every group, so that a DP ledger spans the run. Groups overlap, but
        #: unmask one at a time, in the order they complete: a group's mean is added and its
        #: version published before the next group's mean is added.
        self.agg = make_aggregator(core)
        self._ready: list[_Group] = []
        self._busy = False

    def _new_group(self) -> _Group:
        self._next_group += 1
        g = self._next_group
        sa = SecAggRound(g, [], size=self.core.update_size, params=self.params,
                         dropout_fraction=self.dropout, graph_seed=self._graph_seed(g),
                         identities={} if self.core.config.security.require_identity
                         else None, sealed=False)
        group = _Group(sa, self.core.clock() + self.core.config.policy.round_deadline_s)
        self.groups[g] = group
        return group

    def task_for(self, rec: ClientRecord) -> Task:
        if self.core.done:
            return Task(Action.STOP, version=self.core.version)
        cid = rec.client_id
        if not self.core.ready or cid in self._member_of or self.core.finished:
            # still in a group's protocol, or the run's last version is being made
            return Task(Action.WAIT, version=self.core.version, retry_after_s=0.5)
        group = self._forming or self._new_group()
        self._forming = group
        group.sa.add_member(cid, self._identity(cid))
        group.base[cid] = self.core.version
        self._member_of[cid] = group.sa.round_id
        if len(group.sa.cohort) >= self.core.config.policy.buffer_size:
            group.sa.seal()
            self._plan_inputs(group.sa)
            self._forming = None
            self._progress(group.sa)
        self._tasks += 1
        return Task(Action.TRAIN, version=self.core.version, round=group.sa.round_id,
                    seed=self.core.derive_seed("task", self._tasks, cid))

    def accept(self, rec: ClientRecord, header: UpdateHeader, update: Decoded,
               staleness: int, release: Release = None) -> None:
        raise _push_refused()

    def restore(self, client_id: str, header: UpdateHeader, update: Decoded,
                staleness: int) -> None:
        raise RuntimeError("secure aggregation keeps no acknowledged plaintext updates")

    def on_leave(self, rec: ClientRecord) -> None:
        g = self._member_of.pop(rec.client_id, None)
        group = self.groups.get(g) if g is not None else None
        if group is None:
            return
        if group is self._forming and group.sa.stage == Stage.KEYS \
                and rec.client_id not in group.sa.keys:
            group.sa.cohort.remove(rec.client_id)  # not started: the place goes to another
            group.base.pop(rec.client_id, None)
            return
        group.sa.leave(rec.client_id)
        self._progress(group.sa)

    def tick(self, now: float) -> None:
        for group in list(self.groups.values()):
            sa = group.sa
            if sa.finished or group.unmasking or not sa.sealed or now < group.deadline:
                continue
            log.info("secure-aggregation group %d: stage %s timed out waiting for %d "
                     "client(s)", sa.round_id, sa.stage.name, len(sa.expected()))
            sa.expire()
            group.deadline = self.core.clock() + self.step_timeout_s
            self._changed()
            self._progress(sa)

    def buffered(self) -> int:
        return sum(len(g.sa.inputs) for g in self.groups.values() if not g.sa.finished)

    def _progress(self, sa: SecAggRound) -> None:
        group = self.groups.get(sa.round_id)
        if group is None or group.sa is not sa or sa.finished or group.unmasking:
            return
        moved = False
        while True:
            before = sa.stage
            if not sa.advance():
                break
            moved = True
            group.deadline = self.core.clock() + self.step_timeout_s
            if before == Stage.SHARES and sa.stage == Stage.INPUT:
                self._stale_factors(group)
        if moved:
            self._changed()
        if sa.stage == Stage.UNMASK and not sa.expected():
            group.unmasking = True
            self._ready.append(group)
            self._next_unmask()
        elif sa.stage == Stage.ABANDONED:
            self._done(sa, None, sa.reason)

    def _next_unmask(self) -> None:
        """Unmask the next complete group, unless one is being unmasked."""
        while self._ready and not self._busy:
            group = self._ready.pop(0)
            self._busy = True  # before: an inline publisher finishes within _unmask
            if not self._unmask(group.sa, self.agg, self._done):
                self._busy = False
                self._done(group.sa, None, group.sa.reason)

    def _stale_factors(self, group: _Group) -> None:
        """FedBuff's staleness at the masked input: each member's discount, and the members
        too stale to count taken out of the group (their masks are removed as a dropout's)."""
        limit = self.core.config.policy.max_staleness
        for cid in group.sa.index:
            staleness = self.core.version - group.base.get(cid, self.core.version)
            if staleness > limit:
                group.sa.leave(cid)
                log.info("group %d: %s's update is %d versions old (limit %d); it leaves the "
                         "group", group.sa.round_id, cid, staleness, limit)
                continue
            group.sa.factors[cid] = float(self.staleness(staleness))

    def _done(self, sa: SecAggRound, result: UnmaskResult | None, reason: str) -> None:
        group = self.groups[sa.round_id]
        if group.unmasking and group not in self._ready:  # it was the one being unmasked
            self._busy = False
        group.unmasking = False
        try:
            self._finish(group, result)
        finally:
            self._next_unmask()

    def _finish(self, group: _Group, result: UnmaskResult | None) -> None:
        sa = group.sa
        for cid in sa.cohort:
            if self._member_of.get(cid) == sa.round_id:
                del self._member_of[cid]
        self._done_groups.append(sa.round_id)
        while len(self._done_groups) > _KEEP_FINISHED:
            self.groups.pop(self._done_groups.pop(0), None)
        if result is None:
            self._abandoned(sa)
            return
        if self.core.finished:  # groups overlap: the run's last version is already made
            self.core.publisher.submit(self.agg.reset)
            log.info("group %d is unmasked after the run's last version; it is not published",
                     sa.round_id)
            return
        factors = [sa.factors.get(sa.ids[i], 1.0) for i in sa.included]
        detail = {"staleness_factor_mean": round(sum(factors) / len(factors), 4)}
        self._publish(sa, self.agg, result, detail)

    def _round(self, rec: ClientRecord, round_id: int) -> SecAggRound:
        group = self.groups.get(round_id)
        if group is None:
            raise FailedPrecondition(f"secure-aggregation group {round_id} is not known "
                                     f"(finished long ago, or never formed)",
                                     reason="secagg round not current")
        return group.sa

    def secagg_round(self, round_id: int) -> SecAggRound | None:
        group = self.groups.get(round_id)
        return group.sa if group is not None else None


def _push_refused() -> FailedPrecondition:
    return FailedPrecondition("this run uses secure aggregation: updates are sent masked "
                              "through SecureAggregation.MaskedInput, never through Push",
                              reason="push under secure aggregation")


__all__ = ["SecAggAsyncPolicy", "SecAggPolicy"]
