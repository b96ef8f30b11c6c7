"""One peer's state and decisions, with no transport and no clock.

:class:`PeerNode` holds the peer's model, round, bounded view and inbox; it checks an incoming
model (sender, spec, shape, finiteness, round), decides whom to send to, and mixes. The gRPC
runtime (:class:`~murmura.gossip.PeerRuntime`) and the simulator both drive it, so a simulated
peer refuses, chooses and mixes exactly as a deployed one. Not thread-safe: its driver locks.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from murmura.aggregation import SybilWeighting
from murmura.gossip.config import GossipConfig
from murmura.gossip.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    quote,
)
from murmura.gossip.identity import well_formed
from murmura.gossip.journal import StepJournal, mean_step
from murmura.gossip.mixing import mix, parse_options
from murmura.gossip.topology import expected_senders, stable_hash, targets
from murmura.gossip.view import PeerView
from murmura.protocols import FlatVector, ModelSpec, PeerInfo
from murmura.protocols.codecs import create_codec

log = logging.getLogger(__name__)

__all__ = ["PeerNode", "Received", "training_seed"]

#: Message ids remembered for deduplication (a retried push is taken once).
SEEN_IDS = 4096
#: Departed peers remembered (so second-hand entries do not bring them back).
MAX_DEAD = 4096


@dataclass(frozen=True)
class Received:
    sender: str
    round: int
    model: FlatVector
    num_examples: int
    payload: bytes = b""  # seed mode: the step log the update was replayed from


class PeerNode:
    """A peer's model, round, view and inbox (see the module docstring)."""

    def __init__(self, peer_id: str, spec: ModelSpec, config: GossipConfig, model: FlatVector,
                 *, address: str = "", num_peers: int = 0) -> None:
        spec.check_vector(model)
        self.peer_id, self.spec, self.config, self.address = peer_id, spec, config, address
        self.model = np.array(model, dtype=np.float32, copy=True)
        self.round = 0
        self.own_examples = 1  # examples this peer's latest training saw (mixing weight)
        self.public_key = b""  # set by a signing peer's runtime
        self.view = PeerView(peer_id, config.view_size, seed=config.seed)
        self.num_peers = num_peers  # the run's size when known (Epidemic's s = log2 n)
        # sender -> round -> model: a neighbour that runs ahead may send its next round's model
        # before this peer has mixed the current one; it is kept for that round
        self.inbox: dict[str, dict[int, Received]] = {}
        # peer id -> address found unreachable (or that said goodbye), the newest MAX_DEAD
        self.dead: OrderedDict[str, str] = OrderedDict()
        self.newest = 0  # the round the models mixed so far vouch for (see mix)
        self.mixes = 0  # mixings done (the Sybil trust warm-up counts them)
        # seed mode: the model each recent round started from (replay references), and this
        # peer's own update of the current round
        self.bases: OrderedDict[int, FlatVector] = OrderedDict()
        self.own_update: FlatVector | None = None
        self.own_payload = b""
        # seed mode: a snapshot and the step logs mixed since (catch-up by replay); the run's
        # starting model is the first snapshot, one every peer of the run holds
        self.journal: StepJournal | None = None
        if config.seed_mode:
            seed_codec = create_codec("seed")
            self.journal = StepJournal(0, self.model, lambda payload, base: seed_codec.decode(
                payload, spec.size, reference=base), max_rounds=config.journal_rounds)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.fingerprint = spec.fingerprint()
        self.options = parse_options(config.rule_options)
        self.sybil = (SybilWeighting(spec.size, seed=config.seed, max_clients=max(
            2, 4 * config.view_size, config.history_records)) if config.sybil else None)
        # sybil: sketches of models seen, first-hand or gossiped: (sender, round) -> sketch
        self.records: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._observed: set[tuple[str, int]] = set()

    # -- membership

    def me(self) -> PeerInfo:
        return PeerInfo(self.peer_id, self.address, self.round, 0, self.public_key)

    def members(self) -> list[str]:
        return self.view.ids()

    def merge(self, entries: Sequence[PeerInfo]) -> None:
        """Merge entries heard second-hand, except those of peers found dead at that address
        and malformed ones (a shuffle partner's junk must not spread through the views)."""
        self.view.merge([e for e in entries if self.dead.get(e.peer_id) != e.address
                         and well_formed(e.peer_id, e.address)])

    def heard_from(self, sender: PeerInfo) -> None:
        """The sender contacted this peer itself: it is alive at that address."""
        if not well_formed(sender.peer_id, sender.address):
            return
        if self.dead.get(sender.peer_id) == sender.address:
            del self.dead[sender.peer_id]
        self.view.merge([PeerInfo(sender.peer_id, sender.address, sender.round, 0)])

    def mark_dead(self, peer_id: str, address: str) -> None:
        """A send or shuffle to ``peer_id`` failed for good (or it said goodbye)."""
        self.dead[peer_id] = address
        self.dead.move_to_end(peer_id)
        while len(self.dead) > MAX_DEAD:  # goodbyes are unauthenticated: keep the newest
            self.dead.popitem(last=False)
        entry = self.view.get(peer_id)
        if entry is not None and entry.address == address:
            self.view.remove(peer_id)

    def shuffle_start(self, *, tick: bool = True) -> tuple[PeerInfo | None, list[PeerInfo]]:
        """(partner, entries to offer) for this round's view shuffle."""
        if tick:
            self.view.tick()
        partner = self.view.shuffle_partner()
        if partner is None:
            return None, []
        offer = [e for e in self.view.sample(self.config.shuffle_size)
                 if e.peer_id != partner.peer_id]
        return partner, offer

    def shuffle_answer(self, sender: PeerInfo, offered: Sequence[PeerInfo]) -> list[PeerInfo]:
        """Answer a shuffle: entries of this view for the sender, then take its offer in."""
        reply = [e for e in self.view.sample(self.config.shuffle_size)
                 if e.peer_id != sender.peer_id]
        self.heard_from(sender)
        self.merge(offered)
        return reply

    # -- decisions

    def targets(self, round_: int | None = None) -> list[str]:
        """The peers this peer sends its model to in ``round_`` (default: its round)."""
        r = self.round if round_ is None else round_
        members = self.members()
        return targets(self.config.topology, self.peer_id, r, members,
                       fanout=self.config.fanout_for(self.num_peers or len(members) + 1),
                       degree=self.config.degree, seed=self.config.seed)

    def expected(self) -> int:
        """Models to wait for before mixing (see :class:`GossipConfig.min_messages`)."""
        if self.config.min_messages:
            return self.config.min_messages
        return expected_senders(self.config.topology, self.peer_id, self.members(),
                                degree=self.config.degree)

    def ready(self, round_: int) -> int:
        """How many inbox models count for mixing at ``round_``."""
        return sum(1 for rounds in self.inbox.values() if max(rounds) >= round_)

    # -- incoming

    def check_model(self, sender: str, round_: int, num_examples: int, fingerprint: str) -> None:
        """Refuse a push by its header alone (before any payload byte is decoded)."""
        if fingerprint != self.fingerprint:
            raise FailedPrecondition(f"model spec {quote(fingerprint, 24)} differs from this "
                                     f"peer's {self.fingerprint}")
        if num_examples < 0:
            raise InvalidArgument(f"num_examples must be >= 0, got {num_examples}")
        if round_ < 0 or round_ > self.round + 10 * self.config.max_round_lag + 1000:
            raise InvalidArgument(f"round {round_} is implausible (this peer is at "
                                  f"{self.round})")
        if round_ < self.round - self.config.max_round_lag:
            raise FailedPrecondition(f"round {round_} is stale: this peer is at round "
                                     f"{self.round} and takes models at most "
                                     f"{self.config.max_round_lag} rounds old")

    def receive(self, sender: str, round_: int, message_id: str, model: FlatVector,
                num_examples: int = 1, fingerprint: str | None = None, *,
                payload: bytes = b"") -> bool:
        """Take a neighbour's model into the inbox; False for a duplicate message id.

        Raises a :class:`~murmura.gossip.errors.GossipError` (and changes nothing) for a bad
        model. At most ``max_round_lag`` + 1 rounds are kept per sender (the newest).
        """
        self.check_model(sender, round_, num_examples,
                         self.fingerprint if fingerprint is None else fingerprint)
        if message_id and message_id in self._seen:
            return False
        if model.shape != (self.spec.size,):
            raise InvalidArgument(f"model has {model.size} values, expected {self.spec.size}")
        if not np.isfinite(model).all():
            raise InvalidArgument("model has non-finite values (NaN or infinity)")
        held = self.inbox.get(sender, {})
        limit = self.config.inbox_limit()
        if round_ not in held and sum(map(len, self.inbox.values())) >= limit:
            raise ResourceExhausted(f"this peer holds {limit} models waiting to be mixed "
                                    f"(max_inbox); retry next round")
        if self.sybil is not None:
            self._record(sender, round_, self.sybil.sketch(model))
        rounds = self.inbox.setdefault(sender, {})
        rounds[round_] = Received(sender, round_, model, num_examples, bytes(payload))
        while len(rounds) > self.config.max_round_lag + 1:
            del rounds[min(rounds)]
        if message_id:
            self._seen[message_id] = None
            while len(self._seen) > SEEN_IDS:
                self._seen.popitem(last=False)
        return True

    # -- mixing

    def mix(self) -> int:
        """Mix the inbox into the model (senders in id order); return how many were mixed.

        Per sender: its model of this round if there is one, else its newest older one
        (within ``max_round_lag``), else its earliest newer one. Models of later rounds than
        the one used stay in the inbox for those rounds; older ones are dropped.
        """
        chosen: list[Received] = []
        for sender in sorted(self.inbox):
            rounds = self.inbox[sender]
            usable = [r for r in rounds if r >= self.round - self.config.max_round_lag]
            if not usable:
                del self.inbox[sender]
                continue
            older = [r for r in usable if r <= self.round]
            pick = max(older) if older else min(usable)
            chosen.append(rounds[pick])
            for r in [r for r in rounds if r <= pick]:
                del rounds[r]
            if not rounds:
                del self.inbox[sender]
        if chosen:  # the round the mixed models vouch for: one far-ahead model cannot end
            # this peer's run early (the median of its own round and theirs, the lower one)
            vouched = sorted([self.round, *(r.round for r in chosen)])
            self.newest = max(self.newest, vouched[(len(vouched) - 1) // 2])
        if self.sybil is not None:
            self._observe_gossiped({r.sender for r in chosen})
        if self.config.seed_mode:
            self._mix_updates(chosen)
        elif chosen:
            weighted = self.config.weight_by_examples
            self.mixes += 1
            self.model = mix(self.model, [(r.sender, r.model) for r in chosen],
                             rule=self.config.rule, options=self.options, owner=self.peer_id,
                             sybil=self.sybil,
                             own_weight=max(self.own_examples, 1) if weighted else 1.0,
                             weights=[max(r.num_examples, 1) for r in chosen] if weighted
                             else None, trust_scale=self.trust_scale())
        return len(chosen)

    def trust_scale(self) -> float:
        """The neighbours' trust factor of the current mixing: ``mixes / trust_warmup``, at
        most 1 (see :class:`~murmura.gossip.GossipConfig`)."""
        warmup = self.config.trust_warmup
        return min(1.0, max(self.mixes, 1) / warmup) if warmup > 1 else 1.0

    # -- seed mode

    def start_round(self, round_: int) -> None:
        """Remember the model ``round_`` starts from: received step logs replay onto it."""
        self.bases[round_] = self.model.copy()
        while len(self.bases) > self.config.max_round_lag + 1:
            self.bases.popitem(last=False)

    def base(self, round_: int) -> FlatVector:
        base = self.bases.get(round_)
        if base is None:
            raise Aborted(f"no base model for round {round_} yet or any more (this peer keeps "
                                     f"rounds {min(self.bases, default=0)}.."
                                     f"{max(self.bases, default=0)})")
        return base

    def _mix_updates(self, chosen: Sequence[Received]) -> None:
        """Seed mode: base + the mean of every update (own included), summed in peer-id
        order, so peers with the same base and the same senders agree bit for bit."""
        assert self.own_update is not None, "seed mode: set own_update before mixing"
        updates = sorted([(self.peer_id, self.own_update), *((r.sender, r.model)
                                                              for r in chosen)],
                         key=lambda pair: pair[0])
        self.model = mean_step(self.base(self.round), [u for _, u in updates])
        if self.journal is not None:
            logs = [(self.peer_id, self.own_payload), *((r.sender, r.payload) for r in chosen)]
            if all(p for _, p in logs) and all(r.round == self.round for r in chosen):
                self.journal.record(self.round, logs)
            else:  # an update replayed on another round's base: the logs cannot explain it
                self.journal.rebase(self.round + 1, self.model)
        self.own_update, self.own_payload = None, b""

    # -- Sybil histories spread by gossip (SybilWall-style)

    def _record(self, sender: str, round_: int, sketch: np.ndarray) -> None:
        self.records[(sender, round_)] = sketch
        self.records.move_to_end((sender, round_))
        while len(self.records) > self.config.history_records:
            key, _ = self.records.popitem(last=False)
            self._observed.discard(key)

    def history_offer(self, rng: random.Random) -> list[tuple[str, int, np.ndarray]]:
        """Up to ``history_share`` random recent records (model sketches) for a shuffle
        partner: bounded in count, so in bytes (each is 512 floats)."""
        if self.sybil is None or not self.config.history_share:
            return []
        recent = [k for k in self.records if k[1] >= self.round - 2]
        chosen = rng.sample(recent, min(self.config.history_share, len(recent)))
        return [(s, r, self.records[(s, r)]) for s, r in chosen]

    def take_history(self, records: Sequence[tuple[str, int, np.ndarray]]) -> int:
        """Keep gossiped records (malformed ones and ones about this peer are dropped);
        returns how many were new."""
        if self.sybil is None:
            return 0
        taken = 0
        for sender, round_, sketch in records[: self.config.history_share]:
            sketch = np.asarray(sketch, dtype=np.float64)
            if (sender == self.peer_id or (sender, round_) in self.records
                    or sketch.shape != (self.sybil.dim,) or not np.isfinite(sketch).all()):
                continue
            self._record(sender, round_, sketch)
            taken += 1
        return taken

    def _observe_gossiped(self, direct: set[str]) -> None:
        """Add gossiped records of recent rounds to the senders' histories, as deltas from
        this peer's own model (sketches are linear: sketch(m - own) = sketch(m) - sketch(own));
        direct senders' models enter through :func:`mix` itself. The records are also one
        batch for the collusion screen, as a mixing's received models are: a peer hears
        first-hand from a few peers per round, and the screen judges nobody until it tracks
        enough of them (on the robustness benchmark's distinct backdoor peers, success on the
        honest peers fell from 95 % to 16 % with this alone, docs/robustness.md)."""
        assert self.sybil is not None
        own = self.sybil.sketch(self.model)
        ids: list[str] = []
        rows: list[np.ndarray] = []
        for key, sketch in self.records.items():
            sender, round_ = key
            if key in self._observed or sender in direct or round_ < self.round - 2:
                continue
            self._observed.add(key)
            delta = sketch - own
            self.sybil.observe(sender, delta)
            ids.append(sender)
            rows.append(delta)
        screen = self.sybil.screen
        if screen is not None and len(ids) >= 2:
            screen.observe(ids, np.stack(rows), centre_rows=self.sybil.weights(ids) > 0.5)
        for sender in direct:
            for key in self.records:
                if key[0] == sender:
                    self._observed.add(key)

    def advance(self, round_: int) -> int:
        """After mixing in ``round_``: the next round. A peer that fell behind (a slow device,
        a restart) jumps to the round most of the models it mixed come from, so it never trains
        rounds the network has left behind; a single model claiming a far later round (a
        hostile or confused peer) does not move it."""
        self.round = max(round_ + 1, self.newest)
        return self.round


def training_seed(seed: int, peer_id: str, round_: int) -> int:
    """The local-training seed of ``peer_id`` in ``round_`` (real and simulated peers alike)."""
    return stable_hash(seed, "train", peer_id, round_) % (2**63)
