"""MoDeST-style sampled rounds on deployed peers (topology ``modest``).

de Vos et al., "MoDeST: Bridging the Gap between Federated and Decentralized Learning with
Decentralized Sampling", 2023, https://arxiv.org/abs/2302.13837.

Every peer ranks the members it knows by a hash of (seed, round, role, id)
(:func:`~murmura.gossip.topology.modest_sample`), so peers with the same membership agree on
round r's ``sample_size`` trainers T_r and ``aggregators`` aggregators A_r without talking.
A round is a relay, driven by messages rather than by a clock:

1. a trainer of round r starts when the first aggregate of round r arrives (round 0: the
   run's starting model), waits up to ``round_timeout_s`` for the other aggregators', trains
   from their mean and sends the result (kind ``trained``) to every aggregator of A_r;
2. an aggregator of round r starts when the first trained model of round r arrives, waits up
   to ``round_timeout_s`` for the rest of T_r, aggregates them with the configured rule
   (weights: example counts) and sends the aggregate (kind ``aggregate``, round r + 1) to
   every trainer of T_{r+1}; after the last round, to every member (the final model);
3. every other peer waits, shuffling its view, until it is sampled or the final model comes.

A send that fails for good drops the target from the view, and the sample is recomputed: the
next peer in the hash ranking takes its place (MoDeST's replacement of unresponsive peers).
Receivers therefore accept a sender or a role within the first ``2 k`` of the ranking
(k: the sample's size), not only the first k. Peers must know the whole network
(``view_size`` >= n - 1) for their samples to agree.

The rules (samples, what a receiver accepts, how many models a step waits for, aggregation,
the step due next) are :mod:`murmura.gossip.modest_core`'s, which the simulator runs too;
this module drives them with the runtime's threads, clock and transport.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from murmura.gossip.modest_core import (
    AGGREGATE,
    FINISH,
    KINDS,
    TRAIN,
    TRAINED,
    ModestPlan,
    ModestState,
    Pending,
    merge,
    rank_of,
)
from murmura.gossip.node import Received, training_seed
from murmura.protocols import FlatVector

if TYPE_CHECKING:
    from murmura.gossip.runtime import PeerRuntime

log = logging.getLogger(__name__)

__all__ = ["KINDS", "ModestRounds", "rank_of"]

#: Seconds without any message before an unsampled peer gives up waiting, per round timeout.
STALL_ROUNDS = 30


class ModestRounds:
    """The MoDeST relay for one :class:`~murmura.gossip.PeerRuntime` (see the module
    docstring): drives a :class:`~murmura.gossip.modest_core.ModestState` with the runtime's
    lock, condition, clock, transport, trainer and view; the rules are
    :mod:`murmura.gossip.modest_core`'s, which the simulator runs too."""

    def __init__(self, runtime: PeerRuntime) -> None:
        self.rt = runtime
        self.cfg = runtime.config
        self.plan = ModestPlan.from_config(self.cfg)
        self.state = ModestState(runtime.peer_id, self.plan, inbox_limit=self.cfg.inbox_limit(),
                                 round_timeout_s=self.cfg.round_timeout_s)

    @property
    def box(self) -> dict[tuple[str, int], Pending]:
        """The models waiting for a step, by (kind, round)."""
        return self.state.box

    def members(self) -> list[str]:
        """The members this peer samples from: its view and itself."""
        return sorted({*self.rt.node.members(), self.rt.peer_id})

    # -- incoming (a server thread, under the runtime's lock)

    def accept(self, sender: str, kind: str, round_: int, message_id: str, model: FlatVector,
               num_examples: int, end: int) -> bool:
        """Keep a trained model or an aggregate; False for a duplicate. Raises a typed
        refusal (nothing kept) when the roles do not fit: this peer does not aggregate
        round r, the sender does not train it, and so on."""
        taken = self.state.accept(sender, kind, round_, message_id, model, num_examples,
                                  members=self.members(), end=end, now=self.rt.clock())
        if taken:
            self.rt._arrived.notify_all()
        return taken

    def _keep(self, kind: str, round_: int, model: FlatVector, num_examples: int) -> None:
        """This peer's own copy of what it sends (the caller holds the lock)."""
        self.state.keep(self.rt.peer_id, kind, round_, "", model, num_examples, self.rt.clock())
        self.rt._arrived.notify_all()

    # -- the loop

    def run(self, end: int) -> None:
        """Act in every round this peer is sampled for, until the final model or ``stop``."""
        rt = self.rt
        with rt._lock:
            if rt.node.round == 0 and self.state.start(rt.node.model, self.members(), end,
                                                       rt.clock()):
                rt._arrived.notify_all()
        idle_since = rt.clock()
        while not rt._stop.is_set() and not self.state.finished:
            with rt._arrived:
                due = self.state.due(end)
                if due is None:
                    rt._arrived.wait(self.cfg.round_timeout_s)
                    due = self.state.due(end)
            if due is None:
                if rt.clock() - idle_since > STALL_ROUNDS * max(self.cfg.round_timeout_s, 1.0):
                    log.warning("%s: nothing arrived for %.0f s; leaving the modest run",
                                rt.peer_id, rt.clock() - idle_since)
                    return
                rt._shuffle()
                continue
            step, round_ = due
            if step == FINISH:
                self._finish(end)
            elif step == TRAIN:
                self._train(round_, end)
            else:
                self._aggregate(round_, end)
            idle_since = rt.clock()
            rt._shuffle()

    def _gather(self, step: str, round_: int) -> list[Received]:
        """The models ``step`` of ``round_`` waits for, once they all came or the round
        timeout passed (:meth:`ModestState.wait_s`); they leave the box."""
        rt = self.rt
        with rt._arrived:
            expected = self.plan.expected(step, round_, self.members())
            while not rt._stop.is_set():
                left = self.state.wait_s(step, round_, expected, rt.clock())
                if left <= 0:
                    break
                rt._arrived.wait(left)
            return self.state.take(step, round_)

    def _train(self, round_: int, end: int) -> None:
        rt = self.rt
        start = merge(self._gather(TRAIN, round_))
        with rt._lock:
            self.state.acted(TRAIN, round_)
            rt.node.model, rt.node.round = start, max(rt.node.round, round_)
            rt._training = True
        result = rt.trainer.train(start, rt.settings,
                                  seed=training_seed(self.cfg.seed, rt.peer_id, round_))
        assert result.params is not None, "modest peers need trainers that return models"
        trained = rt.hooked(start, np.asarray(result.params, dtype=np.float32))
        with rt._lock:
            rt._training = False
            rt.node.model = trained
        rt.stats.rounds += 1
        self._deliver(TRAINED, round_, trained, result.num_examples, end)

    def _aggregate(self, round_: int, end: int) -> None:
        rt = self.rt
        trained = self._gather(AGGREGATE, round_)
        model = self.plan.aggregate(trained, rt.spec.size)
        with rt._lock:
            self.state.acted(AGGREGATE, round_)
            rt.node.model, rt.node.round = model, max(rt.node.round, round_ + 1)
        rt.stats.mixed += len(trained)
        # after the last round, the final model goes to every member, this one included
        self._deliver(AGGREGATE, round_ + 1, model, 0, end)
        if rt.on_round is not None:
            rt.on_round(rt.report(round_, model, len(trained)))

    def _finish(self, end: int) -> None:
        rt = self.rt
        finals = self._gather(FINISH, end)
        log.info("%s: final model from %s", rt.peer_id, [f.sender for f in finals])
        with rt._lock:
            rt.node.model, rt.node.round = merge(finals), end
        self.state.finished = True

    def _deliver(self, kind: str, round_: int, model: FlatVector, num_examples: int,
                 end: int) -> None:
        """Send to every recipient (this peer keeps its own copy directly); a target that
        cannot be reached is dropped from the view and the recomputed sample's newcomers are
        sent to, a few passes at most."""
        rt = self.rt
        payload = model.tobytes()
        sent: set[str] = set()
        for _ in range(3):
            with rt._lock:
                todo = [t for t in self.plan.recipients(kind, round_, self.members(), end)
                        if t not in sent]
                entries = {t: rt.node.view.get(t) for t in todo}
                me = rt.node.me()
            if not todo:
                return
            futures: list[Future[bool]] = []
            for t in todo:
                sent.add(t)
                if t == rt.peer_id:
                    with rt._arrived:
                        self._keep(kind, round_, model.copy(), num_examples)
                    continue
                entry = entries[t]
                if entry is not None:
                    futures.append(rt._sender.submit(rt._send, t, entry.address, me, round_,
                                                     payload, num_examples, "dense-f32", kind))
            if all(f.result() for f in futures):
                return
