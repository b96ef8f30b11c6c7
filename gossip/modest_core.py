"""The MoDeST round's rules, with no transport and no clock.

De Vos et al., "MoDeST: Bridging the Gap between Federated and Decentralized Learning with
Decentralized Sampling", 2023, https://arxiv.org/abs/2302.13837.

Deployed peers (:mod:`murmura.gossip.modest`, over gRPC) and the simulator
(:mod:`murmura.simulation.gossip`, on the virtual clock) both run these rules, so they agree
on every decision, bit for bit where it yields a model:

* :class:`ModestPlan`: who trains and who aggregates round r (a hash ranking of the members
  the caller counts as up), whom a trained model or an aggregate goes to, how many models a
  step waits for, which messages fit a receiver's roles, what an aggregator makes of the
  trained models it got (:meth:`ModestPlan.aggregate`) and what a trainer starts from
  (:func:`merge`);
* :class:`ModestState`: one peer's progress through the relay (the models waiting per kind
  and round, the rounds it has acted in, the step due next). Its driver passes the time in
  (``now``) and does the waiting, the training and the sending.

Callers hold any locks; nothing here is thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from murmura.aggregation import create_aggregator
from murmura.gossip.config import GossipConfig
from murmura.gossip.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, quote
from murmura.gossip.mixing import parse_options
from murmura.gossip.node import Received
from murmura.gossip.topology import modest_sample
from murmura.protocols import FlatVector

__all__ = ["AGGREGATE", "FINISH", "GATHERS", "KINDS", "SLACK", "TRAIN", "TRAINED", "ModestPlan",
           "ModestState", "Pending", "merge", "rank_of"]

#: Message kinds (the push header's ``kind``): a trainer's model, an aggregator's result.
TRAINED, AGGREGATE = "trained", "aggregate"
KINDS = (TRAINED, AGGREGATE)
#: Steps a peer takes (:meth:`ModestState.due`); ``train`` and ``aggregate`` are also the
#: roles :func:`~murmura.gossip.topology.modest_sample` ranks for.
TRAIN, FINISH = "train", "finish"
#: A sample accepts peers this many times its size deep in the ranking (replacements).
SLACK = 2
#: The kind of models each step gathers.
GATHERS = {TRAIN: AGGREGATE, AGGREGATE: TRAINED, FINISH: AGGREGATE}


def rank_of(peer: str, round_: int, role: str, members: Sequence[str], *, seed: int) -> int:
    """``peer``'s position in round ``round_``'s ranking for ``role`` (0 = first sampled)."""
    ranked = modest_sample(round_, [*members, peer], len(set(members) | {peer}), seed=seed,
                           role=role)
    return ranked.index(peer)


def merge(aggregates: Sequence[Received]) -> FlatVector:
    """The mean of round r's aggregates, in sender order: what a trainer of round r starts
    from and every peer's final model. The order is part of the rule (float sums are not
    associative), so any two drivers given the same aggregates get the same bits."""
    ordered = sorted(aggregates, key=lambda a: a.sender)
    return np.mean(np.stack([a.model for a in ordered]), axis=0).astype(np.float32)


@dataclass(frozen=True)
class ModestPlan:
    """Who does what in which round: pure functions of (seed, round, the members a peer
    counts as up). A peer drops a member that fails it and asks again, so the next in the
    ranking replaces it (MoDeST's replacement of unresponsive peers); the simulator passes
    the members that are online."""

    seed: int = 0
    sample_size: int = 10
    aggregators: int = 3
    rule: str = "fedavg"
    rule_options: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: GossipConfig) -> ModestPlan:
        """The plan of a gossip run (its seed, sample sizes and aggregation rule)."""
        return cls(cfg.seed, cfg.sample_size, cfg.aggregators, cfg.rule,
                   dict(cfg.rule_options))

    # -- samples

    def trainers_of(self, round_: int, members: Sequence[str]) -> list[str]:
        """Round ``round_``'s trainers T_r: the first ``sample_size`` of its train ranking."""
        return modest_sample(round_, members, self.sample_size, seed=self.seed, role=TRAIN)

    def aggregators_of(self, round_: int, members: Sequence[str]) -> list[str]:
        """Round ``round_``'s aggregators A_r: the first ``aggregators`` of its ranking."""
        return modest_sample(round_, members, self.aggregators, seed=self.seed,
                             role=AGGREGATE)

    def recipients(self, kind: str, round_: int, members: Sequence[str], end: int
                   ) -> list[str]:
        """Whom a model of (``kind``, ``round_``) goes to: a trained model to A_r, an
        aggregate (round r + 1) to T_{r+1}, and the last one (round ``end``) to every member,
        so that every peer ends with the final model."""
        if kind == TRAINED:
            return self.aggregators_of(round_, members)
        if round_ >= end:
            return sorted(set(members))
        return self.trainers_of(round_, members)

    def within(self, peer: str, round_: int, role: str, members: Sequence[str]) -> bool:
        """Whether ``peer`` may hold ``role`` in ``round_``: within ``SLACK`` times the
        sample's size of the ranking, as replacements of failed peers may be."""
        size = self.sample_size if role == TRAIN else self.aggregators
        return rank_of(peer, round_, role, members, seed=self.seed) < SLACK * size

    # -- rounds

    def expected(self, step: str, round_: int, members: Sequence[str]) -> int:
        """How many models complete ``step`` of ``round_`` before its timeout: every
        trainer's model for an aggregator; one aggregate per aggregator for a trainer or the
        finish (counted from the configuration, not from a view that shrinks as finished
        peers say goodbye); round 0's trainers start from the run's model, their one
        'aggregate'."""
        if step == AGGREGATE:
            return len(self.trainers_of(round_, members))
        return min(self.aggregators, len(set(members))) if round_ else 1

    def check(self, me: str, sender: str, kind: str, round_: int, members: Sequence[str],
              end: int) -> None:
        """Refuse (a typed error) a message that does not fit: a round out of range, a
        trained model for a peer that does not aggregate that round or from one that does not
        train it, an aggregate for a peer that does not train the next round or from one that
        did not aggregate the last, an unknown kind."""
        if kind == TRAINED:
            if round_ >= end:
                raise InvalidArgument(f"a trained model's round must be 0..{end - 1}, got "
                                      f"{round_}")
            if not self.within(me, round_, AGGREGATE, members):
                raise FailedPrecondition(f"this peer does not aggregate round {round_}")
            if not self.within(sender, round_, TRAIN, members):
                raise FailedPrecondition(f"peer {quote(sender)} does not train round {round_}")
        elif kind == AGGREGATE:
            if round_ < 1 or round_ > end:
                raise InvalidArgument(f"an aggregate's round must be 1..{end}, got {round_}")
            if round_ < end and not self.within(me, round_, TRAIN, members):
                raise FailedPrecondition(f"this peer does not train round {round_}")
            if not self.within(sender, round_ - 1, AGGREGATE, members):
                raise FailedPrecondition(f"peer {quote(sender)} does not aggregate round "
                                         f"{round_ - 1}")
        else:
            raise InvalidArgument(f"kind must be one of {KINDS} in a modest run, got "
                                  f"{quote(kind)}")

    def aggregate(self, trained: Sequence[Received], size: int) -> FlatVector:
        """An aggregator's result: the configured rule over the trained models in sender
        order, weighted by their example counts (at least 1, which the rules require)."""
        agg = create_aggregator(self.rule, size, **parse_options(self.rule_options))
        for r in sorted(trained, key=lambda t: t.sender):
            agg.add(r.model, float(max(r.num_examples, 1)), client_id=r.sender)
        return agg.result().astype(np.float32)


@dataclass
class Pending:
    """Models of one (kind, round) that arrived: sender -> model, and when the first came."""

    first_at: float
    models: dict[str, Received]


class ModestState:
    """One peer's progress through the MoDeST relay: what it keeps, what is due, when a step
    may start. The driver passes ``now`` (its clock) in and does the waiting."""

    def __init__(self, me: str, plan: ModestPlan, *, inbox_limit: int,
                 round_timeout_s: float) -> None:
        self.me, self.plan = me, plan
        self.inbox_limit, self.round_timeout_s = inbox_limit, round_timeout_s
        self.box: dict[tuple[str, int], Pending] = {}
        self.done: dict[str, int] = {TRAIN: -1, AGGREGATE: -1}  # last round acted, per role
        self.finished = False
        self._seen: set[str] = set()

    def start(self, model: FlatVector, members: Sequence[str], end: int, now: float) -> bool:
        """Before round 0: a trainer of round 0 keeps the run's starting model as that round's
        one aggregate, so it trains at once. True when it does."""
        if end < 1 or self.me not in self.plan.trainers_of(0, members):
            return False
        self.keep(self.me, AGGREGATE, 0, "", model.copy(), 0, now)
        return True

    def accept(self, sender: str, kind: str, round_: int, message_id: str, model: FlatVector,
               num_examples: int, *, members: Sequence[str], end: int, now: float) -> bool:
        """Keep a trained model or an aggregate; False for a duplicate. Raises a typed
        refusal (nothing kept) when the roles do not fit (:meth:`ModestPlan.check`), the
        round is over here, or the inbox is full."""
        self.plan.check(self.me, sender, kind, round_, members, end)
        if message_id and message_id in self._seen:
            return False
        if round_ <= self.done[_role_of(kind)]:
            raise FailedPrecondition(f"round {round_} of kind {kind!r} is over at this peer")
        self.keep(sender, kind, round_, message_id, model, num_examples, now)
        return True

    def keep(self, sender: str, kind: str, round_: int, message_id: str, model: FlatVector,
             num_examples: int, now: float) -> None:
        """Hold a model for its step (unchecked: this peer's own copies come here directly);
        ResourceExhausted when ``inbox_limit`` models already wait."""
        pending = self.box.get((kind, round_))
        held = sum(len(p.models) for p in self.box.values())
        if (pending is None or sender not in pending.models) and held >= self.inbox_limit:
            raise ResourceExhausted(f"this peer holds {self.inbox_limit} models waiting "
                                    f"(max_inbox); retry later")
        if pending is None:
            pending = self.box[(kind, round_)] = Pending(now, {})
        pending.models[sender] = Received(sender, round_, model, num_examples)
        if message_id:
            self._seen.add(message_id)
            if len(self._seen) > 4 * self.inbox_limit + 4096:
                self._seen.clear()  # ids only deduplicate retries, seconds apart

    def due(self, end: int) -> tuple[str, int] | None:
        """The earliest step this peer should take now, (``train``, ``aggregate`` or
        ``finish``, round), dropping models whose round is over. Within a round, training
        comes before aggregating."""
        for key in sorted(self.box, key=lambda k: (k[1], k[0] == TRAINED)):
            kind, round_ = key
            if round_ <= self.done[_role_of(kind)] or (kind == TRAINED and round_ >= end):
                del self.box[key]
                continue
            if kind == TRAINED:
                return AGGREGATE, round_
            return (FINISH if round_ == end else TRAIN), round_
        return None

    def wait_s(self, step: str, round_: int, expected: int, now: float) -> float:
        """Seconds a step still waits for its models: 0 once ``expected`` came or
        ``round_timeout_s`` passed since the first (the step then runs with what it has)."""
        pending = self.box[(GATHERS[step], round_)]
        if len(pending.models) >= expected:
            return 0.0
        return max(pending.first_at + self.round_timeout_s - now, 0.0)

    def take(self, step: str, round_: int) -> list[Received]:
        """The models a step gathered, in sender order; they leave the box."""
        pending = self.box.pop((GATHERS[step], round_))
        return [pending.models[s] for s in sorted(pending.models)]

    def acted(self, step: str, round_: int) -> None:
        """Record that this peer trained or aggregated ``round_``: later models for it are
        over (refused, or dropped from the box)."""
        self.done[step] = round_


def _role_of(kind: str) -> str:
    """The role whose progress makes a model of ``kind`` late: aggregates feed training,
    trained models feed aggregation."""
    return TRAIN if kind == AGGREGATE else AGGREGATE
