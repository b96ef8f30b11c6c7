"""One round of the gossip simulator, for each kind of round: epidemic (first-order peers
that train, send to their targets and mix), seed mode (zeroth-order peers that send step logs
and replay the ones they receive), and MoDeST (sampled trainers and aggregators).

Each round trains the online peers through the simulator's executors (or the zeroth-order
trainer), delivers the models as function calls to the receivers' :class:`PeerNode`, and
returns what was sent and how long the round took in virtual time. Set-up, the round loop,
failures and metrics stay in :mod:`murmura.simulation.gossip`; :class:`GossipRounds` is mixed
into its :class:`~murmura.simulation.gossip.GossipSimulation` and shares its state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from murmura.client.malicious import Attack
from murmura.client.zo import SEED_CODEC, ZOTrainer
from murmura.gossip import GossipConfig, PeerNode, training_seed
from murmura.gossip.errors import ResourceExhausted
from murmura.gossip.modest_core import ModestPlan, merge
from murmura.gossip.node import Received
from murmura.protocols import FlatVector, ModelSpec, PeerInfo, TaskSettings
from murmura.protocols.codecs import create_codec
from murmura.simulation.data import SimulationData
from murmura.simulation.devices import DevicePopulation
from murmura.simulation.execution import Executor, Job

if TYPE_CHECKING:
    from murmura.simulation.gossip import SybilFlood


class GossipRounds:
    """The rounds of a :class:`~murmura.simulation.gossip.GossipSimulation` (mixed into it;
    its ``__init__`` sets the state below)."""

    gossip: GossipConfig
    settings: TaskSettings
    spec: ModelSpec
    data: SimulationData
    nodes: list[PeerNode]
    ids: list[str]
    index: dict[str, int]
    devices: DevicePopulation
    steps: np.ndarray
    executor: Executor
    zo: ZOTrainer | None
    attacks: dict[int, Attack]
    sybils: SybilFlood | None
    sybil_set: set[int]
    push_bytes: int
    refused: int
    _jitter_rng: np.random.Generator
    # modest: the round of the aggregate each peer holds, the latest aggregate's (round,
    # aggregators that hold it), the peers of the previous round and the latest merged model
    _plan: ModestPlan
    _has: np.ndarray
    _latest: tuple[int, list[int]]
    _was_online: np.ndarray
    _modest_model: FlatVector

    if TYPE_CHECKING:  # the simulation's wire size and shuffle
        def wire_bytes(self, payload_bytes: int) -> int: ...
        def _shuffle(self, node: PeerNode, *, tick: bool = True,
                     online: np.ndarray | None = None) -> None: ...

    def _train(self, peers: list[int], round_: int) -> dict[int, tuple[FlatVector, int]]:
        jobs = [Job(i, self.nodes[i].model, training_seed(self.gossip.seed, self.ids[i], round_))
                for i in peers]
        results = self.executor.run(jobs, self.settings) if jobs else []
        out: dict[int, tuple[FlatVector, int]] = {}
        for i, r in zip(peers, results, strict=True):
            model = np.asarray(r.params, dtype=np.float32)
            attack = self.attacks.get(i)
            if attack is not None and attack.update is not None:
                base = self.nodes[i].model
                model = (base + attack.update(model - base)).astype(np.float32)
            out[i] = (model, r.num_examples)
        if self.sybil_set:
            self._clone(out)
        return out

    def _clone(self, trained: dict[int, tuple[FlatVector, int]]) -> None:
        """Every Sybil identity sends the attacker's one model (with a little jitter)."""
        sybils = sorted(i for i in trained if i in self.sybil_set)
        if not sybils:
            return
        lead = sybils[0]
        base = self.nodes[lead].model
        update = trained[lead][0] - base
        scale = float(np.linalg.norm(update)) / math.sqrt(update.size) * self.sybils.jitter \
            if self.sybils else 0.0
        for i in sybils:
            noise = self._jitter_rng.standard_normal(update.size).astype(np.float32) * scale
            trained[i] = ((base + update + noise).astype(np.float32), trained[lead][1])

    def _round_time(self, peers: list[int], sends: dict[int, int],
                    push_bytes: dict[int, int] | None = None) -> float:
        d = self.devices
        times = [self.steps[i] * d.step_time_s[i] + sends.get(i, 0)
                 * (push_bytes[i] if push_bytes else self.push_bytes)
                 / d.uplink_bytes_per_s[i] + 2 * d.latency_s[i] for i in peers]
        return float(max(times, default=0.0))

    def _deliveries(self, live: list[int], on: np.ndarray, round_: int,
                    sends: dict[int, int]) -> Iterator[tuple[int, int, PeerInfo]]:
        """(sender, receiver, the sender's entry) for each send of ``round_`` to an online
        peer; every send is counted in ``sends``, and a sender drops an offline target from
        its view, as a deployed peer does when a push fails."""
        for i in live:
            node = self.nodes[i]
            me = node.me()
            for t in node.targets(round_):
                j = self.index[t]
                sends[i] = sends.get(i, 0) + 1
                if not on[j]:
                    node.mark_dead(t, f"sim:{j}")
                    continue
                yield i, j, me

    def _deliver(self, j: int, sender: PeerInfo, round_: int, model: FlatVector,
                 num_examples: int, *, payload: bytes = b"") -> bool:
        """Peer ``j`` receives a model; False when it refuses it (a full inbox), as a
        deployed peer's RESOURCE_EXHAUSTED would make the push fail."""
        try:
            self.nodes[j].receive(sender.peer_id, round_, "", model, num_examples,
                                  payload=payload)
        except ResourceExhausted:
            self.refused += 1
            return False
        return True

    def _seed_round(self, round_: int, on: np.ndarray) -> tuple[int, int, float]:
        """Seed mode: each online peer trains zeroth-order from its own model and sends its
        step log; each receiver replays the log on the model it started the round from and
        mixes the mean of the updates (as :class:`~murmura.gossip.PeerRuntime` does).
        Returns (messages, bytes, virtual seconds)."""
        assert self.zo is not None
        codec = create_codec(SEED_CODEC)
        live = [i for i in range(len(self.nodes)) if on[i]]
        logs: dict[int, tuple[bytes, int]] = {}
        for i in live:
            node = self.nodes[i]
            node.round = round_
            node.start_round(round_)
            self.zo.data = self.data.train.subset(self.data.shares[i])
            result = self.zo.train(node.model, self.settings,
                                   seed=training_seed(self.gossip.seed, self.ids[i], round_))
            assert result.params is not None and result.encoded is not None
            node.own_update = np.subtract(result.params, node.base(round_), dtype=np.float32)
            node.own_payload = result.encoded[1]
            node.model = result.params
            logs[i] = (result.encoded[1], result.num_examples)
        sends: dict[int, int] = {}
        for i, j, me in self._deliveries(live, on, round_, sends):
            update = codec.decode(logs[i][0], self.spec.size,
                                  reference=self.nodes[j].base(round_))
            if self._deliver(j, me, round_, update, logs[i][1], payload=logs[i][0]):
                self.nodes[j].heard_from(me)
        push = {i: self.wire_bytes(len(logs[i][0])) for i in live}
        sent_bytes = sum(n * push[i] for i, n in sends.items())
        for i in live:
            node = self.nodes[i]
            node.mix()
            node.advance(round_)
        for i in live:
            self._shuffle(self.nodes[i], online=on)
        return sum(sends.values()), sent_bytes, self._round_time(live, sends, push)

    def _epidemic_round(self, round_: int, on: np.ndarray) -> tuple[int, float]:
        live = [i for i in range(len(self.nodes)) if on[i]]
        for i in live:
            self.nodes[i].round = round_
        trained = self._train(live, round_)
        for i in live:
            self.nodes[i].model, self.nodes[i].own_examples = trained[i]
        sends: dict[int, int] = {}
        for i, j, me in self._deliveries(live, on, round_, sends):
            if self._deliver(j, me, round_, trained[i][0], trained[i][1]):
                self.nodes[j].heard_from(me)
        for i in live:
            node = self.nodes[i]
            if i not in self.sybil_set:
                node.mix()
            else:
                node.inbox.clear()
            node.advance(round_)
        for i in live:
            self._shuffle(self.nodes[i], online=on)
        return sum(sends.values()), self._round_time(live, sends)

    def _modest_round(self, round_: int, on: np.ndarray) -> tuple[int, float]:
        """One MoDeST round, with the deployed peers' rules (:mod:`murmura.gossip.modest_core`):
        the round's trainers train, every aggregator aggregates all of their models, and the
        next round's trainers start from the mean of the aggregates."""
        plan = self._plan
        # membership as a failure detector with one round of delay sees it: the peers that
        # took part in the previous round (every peer at the start)
        members = [self.ids[i] for i in range(len(self.nodes)) if self._was_online[i]]
        self._was_online = on.copy()
        # MoDeST replaces sampled peers that do not answer by the next ones in the hash
        # ranking: the plan samples from the members that are online, as a deployed peer
        # samples from its view once the failed pushes have dropped the others
        up = [p for p in members if on[self.index[p]]]
        trainers = [self.index[p] for p in plan.trainers_of(round_, up)]
        aggs = [self.index[p] for p in plan.aggregators_of(round_, up)]
        pulls = self._modest_fetch(trainers, on)
        trained = self._train(trainers, round_)
        models = [Received(self.ids[i], round_, *trained[i]) for i in trainers]
        sends = {i: sum(1 for a in aggs if a != i) for i in trainers}
        online = [self.ids[i] for i in range(len(self.nodes)) if on[i]]
        nxt = [self.index[p] for p in plan.trainers_of(round_ + 1, online)]
        results = []
        for a in aggs if models else []:  # no trainer online: the round is lost
            model = plan.aggregate(models, self.spec.size)  # each aggregator got them all
            self.nodes[a].model = model
            results.append(Received(self.ids[a], round_ + 1, model, 0))
            sends[a] = sends.get(a, 0) + sum(1 for t in nxt if t != a)
        if results:
            merged = merge(results)
            for t in nxt:
                self.nodes[t].model = merged.copy()
                self._has[t] = round_ + 1
            self._modest_model = merged
            self._latest = (round_ + 1, aggs)
        for i in range(len(self.nodes)):
            self.nodes[i].round = round_ + 1
        return sum(sends.values()) + pulls, self._round_time(trainers + aggs, sends)

    def _modest_fetch(self, trainers: list[int], on: np.ndarray) -> int:
        """A trainer whose model is older than the latest aggregate pulls it from one of the
        aggregators that made it, if one is online (as MoDeST's participants do); returns the
        number of model transfers."""
        version, holders = self._latest
        pulls = 0
        for t in trainers:
            if self._has[t] >= version:
                continue
            source = next((a for a in holders if on[a]), None)
            if source is None:
                continue
            self.nodes[t].model = self.nodes[source].model.copy()
            self._has[t] = version
            pulls += 1
        return pulls
