"""Gossip mode on the virtual clock: thousands of peers with no server, on one machine.

Each peer is a :class:`~murmura.gossip.PeerNode` (the class a deployed peer's runtime
drives), so whom it sends to, what it accepts, how it mixes and how its bounded view shuffles
are the deployed code; only the transport is a function call and time is virtual. Rounds are
synchronous in virtual time: a round lasts as long as its slowest online peer needs to train
(steps x its device's seconds per step) and push its models over its uplink (plus latency),
using the simulator's device and availability models. Local training runs through the
simulator's executors (vectorised with ``torch.func`` when the model allows), one job per
online peer starting from that peer's own model, seeded as the deployed peer seeds it
(:func:`~murmura.gossip.training_seed`).

Two topologies of rounds:

* ``epidemic``, ``ring``, ``k-regular``: every online peer trains, sends to its targets, mixes
  what it received (de Vos et al., NeurIPS 2023);
* ``modest``: a hash of (seed, round) samples ``sample_size`` trainers and ``aggregators``
  aggregators from the membership; trainers send their trained models to the round's
  aggregators, which average them (the configured rule) and send the result to the next
  round's trainers (MoDeST, de Vos et al. 2023), with the deployed peers' rules
  (:mod:`murmura.gossip.modest_core`). A round none of whose aggregators is online is lost
  and the next trainers continue from what they have.

Failures: ``churn_per_round`` takes each peer offline for a round with that probability
(hashed, reproducible); ``fail_fraction`` of the peers crash for good at ``fail_round``.
A send to an offline peer fails and the sender drops it from its view, as a deployed peer does.

The rounds themselves are :mod:`murmura.simulation.gossip_rounds`; this module sets the
peers up, decides who is online, runs the rounds and scores the models.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from murmura.client.malicious import Attack
from murmura.client.zo import ZOTrainer
from murmura.gossip import GossipConfig, PeerNode
from murmura.gossip.modest_core import ModestPlan
from murmura.gossip.topology import stable_hash
from murmura.protocols import FlatVector, ModelSpec, PeerInfo, PeerModelHeader, serde
from murmura.server.outputs import RunRecorder
from murmura.simulation.attacks import check_attacks, poison_data
from murmura.simulation.config import SimulationConfig, output_dir
from murmura.simulation.data import SimulationData, load_simulation_data
from murmura.simulation.devices import AlwaysOn, Availability, Churn, DevicePopulation
from murmura.simulation.execution import Executor, LoopExecutor, default_workers
from murmura.simulation.gossip_rounds import GossipRounds
from murmura.simulation.vectorised import VectorisationError, VectorisedExecutor
from murmura.tasks import TaskConfig
from murmura.tasks.models import seeded_init

log = logging.getLogger(__name__)

__all__ = ["GossipFailures", "GossipResult", "GossipSimulation", "SybilFlood",
           "evaluate_many", "peer_id", "simulate_gossip"]


def peer_id(index: int) -> str:
    """The id of simulated peer ``index``, as ``murmura run --gossip`` names its peers."""
    return f"peer-{index:03d}"


@dataclass(frozen=True)
class GossipFailures:
    """Who is offline when: per-round churn and a one-off crash."""

    churn_per_round: float = 0.0
    fail_fraction: float = 0.0
    fail_round: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.churn_per_round < 1 and 0 <= self.fail_fraction < 1):
            raise ValueError("churn_per_round and fail_fraction must lie in [0, 1)")
        if self.fail_round < 0:
            raise ValueError("fail_round must be >= 0")


@dataclass(frozen=True)
class SybilFlood:
    """One attacker behind many identities (``peers``): every identity sends the attacker's
    model (trained on its poisoned data), each with a little independent noise (``jitter``,
    relative to the update's norm) so the clones are not byte-identical."""

    peers: tuple[int, ...]
    jitter: float = 0.05


@dataclass
class GossipResult:
    rows: list[dict[str, Any]]
    models: np.ndarray
    summary: dict[str, Any]
    wall_s: float
    virtual_s: float
    bytes_per_peer_round: float

    @property
    def final_accuracy(self) -> float | None:
        return self.rows[-1].get("accuracy") if self.rows else None


def evaluate_many(model_factory: Callable[[], torch.nn.Module], spec: ModelSpec,
                  models: np.ndarray, x: np.ndarray, y: np.ndarray, *, chunk: int = 256
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(accuracy, loss) of each row of ``models`` on (x, y), vectorised with torch.func."""
    from torch.func import functional_call, vmap

    module = model_factory().eval()
    xt, yt = torch.from_numpy(np.asarray(x, dtype=np.float32)), torch.from_numpy(y)
    offsets = spec.offsets()
    accs, losses = [], []
    for start in range(0, len(models), chunk):
        block = torch.from_numpy(np.ascontiguousarray(models[start:start + chunk]))
        params = {t.name: block[:, off:off + t.numel].reshape(-1, *t.shape)
                  for t, off in zip(spec.tensors, offsets, strict=True)}

        def one(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            logits = functional_call(module, p, (xt,))
            loss = torch.nn.functional.cross_entropy(logits, yt)
            return (logits.argmax(1) == yt).float().mean(), loss

        with torch.no_grad():
            a, loss = vmap(one)(params)
        accs.append(a.numpy())
        losses.append(loss.numpy())
    return np.concatenate(accs).astype(np.float64), np.concatenate(losses).astype(np.float64)


class GossipSimulation(GossipRounds):
    """Simulated peers (see the module docstring). :meth:`run` returns a :class:`GossipResult`.

    ``attacks`` (by peer index) are the attacks a deployed peer runs (``murmura peer
    --attack``): their data transform poisons the peer's share, their update transform each
    update. ``sybils`` floods the network with one attacker's clones. ``targets`` lists
    (source, target) label pairs whose flip rate on honest peers' models is reported as
    ``attack_success``.
    """

    def __init__(self, task: TaskConfig, gossip: GossipConfig, sim: SimulationConfig, *,
                 failures: GossipFailures | None = None, data: SimulationData | None = None,
                 executor: Executor | None = None, out_dir: str | Path | None | bool = True,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 attacks: Mapping[int, Attack] | None = None, sybils: SybilFlood | None = None,
                 attack_pair: tuple[int, int] | None = None, eval_every: int = 1) -> None:
        if gossip.seed_mode and (attacks or sybils):
            raise ValueError("attacks and Sybil floods are simulated with first-order peers "
                             "only (seed mode is off for them)")
        self.task_config, self.gossip, self.sim = task, gossip, sim
        self.failures = failures or GossipFailures()
        n = sim.clients
        self.data = data if data is not None else load_simulation_data(task, sim)
        self.attacks = check_attacks(attacks, n)
        self.data = poison_data(self.data, self.attacks)
        self.sybils = sybils
        self.sybil_set = set(sybils.peers) if sybils else set()
        self.attack_pair = attack_pair
        self.eval_every = max(1, eval_every)
        self.settings = gossip.settings()
        self.out_dir = output_dir(sim, out_dir)
        self.progress = progress
        factory = self.data.task.model_factory
        start_module = seeded_init(factory, gossip.seed)
        self.spec = ModelSpec.from_module(start_module)
        start = self.spec.flatten(start_module)
        self.ids = [peer_id(i) for i in range(n)]
        self.nodes = [PeerNode(self.ids[i], self.spec, gossip, start,
                               address=f"sim:{i}", num_peers=n) for i in range(n)]
        self.index = {pid: i for i, pid in enumerate(self.ids)}
        self.devices = DevicePopulation.sample(
            n, seed=gossip.seed, step_time_s=sim.step_time_s, speed_spread=sim.speed_spread,
            uplink_mbps=sim.uplink_mbps, downlink_mbps=sim.downlink_mbps,
            latency_ms=sim.latency_ms, bandwidth_spread=sim.bandwidth_spread)
        self.availability: Availability = (
            Churn(n, mean_online_s=sim.mean_online_s, mean_offline_s=sim.mean_offline_s,
                  seed=gossip.seed) if sim.availability == "churn" else AlwaysOn())
        self._online_state = np.ones(n, dtype=bool)
        self._online_until = np.full(n, math.inf)
        for i in range(n):
            state, until = self.availability.initial(i)
            self._online_state[i], self._online_until[i] = state, until
        sizes = self.data.sizes()
        b = self.settings.batch_size
        self.steps = (np.full(n, self.settings.local_steps) if self.settings.local_steps
                      else self.settings.local_epochs * ((sizes + b - 1) // b))
        # seed mode trains zeroth-order with the deployed peers' trainer (one module, the data
        # share swapped per peer); otherwise the simulator's executors train first-order
        self.zo = (ZOTrainer(factory(), self.data.train, device="cpu")
                   if gossip.seed_mode else None)
        self.executor = executor or (
            LoopExecutor(factory, self.data.train, self.data.shares) if gossip.seed_mode
            else self._choose_executor())
        header = PeerModelHeader(sender=PeerInfo(self.ids[-1], "127.0.0.1:50000", 99999, 0),
                                 message_id="x" * 12, round=99999, num_examples=int(sizes.max()),
                                 codec="dense-f32", payload_bytes=self.spec.nbytes,
                                 spec_fingerprint=self.spec.fingerprint())
        # the bytes a deployed peer puts on the wire per model push (header + framed chunks)
        self._header_bytes = serde.peer_model_header_to_proto(header).ByteSize() + 2
        self.push_bytes = self.wire_bytes(self.spec.nbytes)
        self.time_s = 0.0
        self.bytes_sent = 0
        #: Updates sent in all rounds so far: rows and the summary count the run's total
        #: (as bytes_up does), each row's own round in ``updates_in_round``.
        self.updates_sent = 0
        self.refused = 0  # deliveries a full inbox refused
        self.rows: list[dict[str, Any]] = []
        self.recorder = None
        if self.out_dir is not None:
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
            self.recorder = RunRecorder(self.out_dir, config={
                "task": asdict(task), "gossip": asdict(gossip), "simulation": asdict(sim),
                "failures": asdict(self.failures)})
        self._crashed = self._crash_set()
        self._was_online = np.ones(n, dtype=bool)
        # modest: the round of the aggregate each peer holds, and the latest aggregate's
        # (round, aggregators that hold it)
        self._has = np.zeros(n, dtype=np.int64)
        self._latest: tuple[int, list[int]] = (0, [])
        self._plan = ModestPlan.from_config(gossip)
        self._attacker_model: FlatVector | None = None
        self._jitter_rng = np.random.default_rng([gossip.seed, 0x5B1])
        self._rng = random.Random(gossip.seed)
        self._bootstrap()

    def wire_bytes(self, payload_bytes: int) -> int:
        """Bytes a deployed peer puts on the wire for one push of ``payload_bytes`` (the
        header chunk and the framed data chunks)."""
        return self._header_bytes + sum(
            serde.data_chunk_wire_bytes(min(serde.CHUNK_BYTES, payload_bytes - s))
            for s in range(0, payload_bytes, serde.CHUNK_BYTES))

    # -- set-up

    def _choose_executor(self) -> Executor:
        d = self.data
        if self.sim.vectorise != "off" and self.sim.executor in ("auto", "vmap"):
            try:
                ex = VectorisedExecutor(d.task.model_factory, d.train, d.shares,
                                        chunk_size=self.sim.chunk_size)
                ex.probe(self.settings)
                return ex
            except VectorisationError as exc:
                log.warning("vectorised training unavailable (%s); using a loop", exc)
        return LoopExecutor(d.task.model_factory, d.train, d.shares)

    def _bootstrap(self) -> None:
        """Peers join through peer 0, then shuffle a few times, as deployed peers do before
        their first round (their views start bounded and random)."""
        first = self.nodes[0]
        for node in self.nodes[1:]:
            reply = first.shuffle_answer(node.me(), [])
            node.heard_from(first.me())
            node.merge(reply)
        for _ in range(max(3, math.ceil(math.log2(len(self.nodes) + 1)))):
            for node in self.nodes:
                self._shuffle(node, tick=False)

    def _crash_set(self) -> set[int]:
        f = self.failures
        if not f.fail_fraction:
            return set()
        ranked = sorted(range(len(self.nodes)),
                        key=lambda i: stable_hash(self.gossip.seed, "crash", i))
        return set(ranked[: int(round(f.fail_fraction * len(self.nodes)))])

    def online(self, round_: int) -> np.ndarray:
        """Which peers take part in ``round_``."""
        n = len(self.nodes)
        on = np.ones(n, dtype=bool)
        if not isinstance(self.availability, AlwaysOn):
            for i in range(n):
                while self._online_until[i] <= self.time_s:
                    self._online_state[i] = not self._online_state[i]
                    self._online_until[i] = self.availability.next_transition(
                        i, self._online_until[i], bool(self._online_state[i]))
                on[i] = self._online_state[i]
        f = self.failures
        if f.churn_per_round:
            draw = np.array([stable_hash(self.gossip.seed, "churn", round_, i) / 2**64
                             for i in range(n)])
            on &= draw >= f.churn_per_round
        if self._crashed and round_ >= f.fail_round:
            on[list(self._crashed)] = False
        return on

    # -- one round (each kind of round is in gossip_rounds.py)

    def _shuffle(self, node: PeerNode, *, tick: bool = True,
                 online: np.ndarray | None = None) -> None:
        partner, offer = node.shuffle_start(tick=tick)
        if partner is None:
            return
        j = self.index[partner.peer_id]
        if online is not None and not online[j]:
            node.mark_dead(partner.peer_id, partner.address)
            return
        other = self.nodes[j]
        reply = other.shuffle_answer(node.me(), offer)
        node.heard_from(other.me())
        node.merge(reply)
        if node.sybil is not None:
            other.take_history(node.history_offer(self._rng))
            node.take_history(other.history_offer(self._rng))

    def step(self, round_: int) -> dict[str, Any]:
        on = self.online(round_)
        if self.gossip.topology == "modest":
            sent, train_s = self._modest_round(round_, on)
            sent_bytes = sent * self.push_bytes
        elif self.gossip.seed_mode:
            sent, sent_bytes, train_s = self._seed_round(round_, on)
        else:
            sent, train_s = self._epidemic_round(round_, on)
            sent_bytes = sent * self.push_bytes
        self.bytes_sent += sent_bytes
        self.updates_sent += sent
        self.time_s += train_s
        row: dict[str, Any] = {"version": round_ + 1, "round": round_ + 1,
                               "peers": int(on.sum()), "bytes_up": self.bytes_sent,
                               "updates": self.updates_sent, "updates_in_round": sent,
                               "time_s": self.time_s,
                               "bytes_per_peer": sent_bytes / max(int(on.sum()), 1)}
        if (round_ + 1) % self.eval_every == 0 or round_ + 1 == self.gossip.rounds:
            row.update(self.evaluate(round_, on))
        return row

    # -- metrics

    def evaluate(self, round_: int, on: np.ndarray) -> dict[str, Any]:
        test = self.data.task.test
        honest = [i for i in range(len(self.nodes)) if i not in self.sybil_set
                  and i not in self.attacks]
        if self.gossip.topology == "modest":
            model = getattr(self, "_modest_model", self.nodes[0].model)
            stack = model[None, :]
        else:
            stack = np.stack([self.nodes[i].model for i in honest])
        acc, loss = evaluate_many(self.data.task.model_factory, self.spec, stack, test.x, test.y)
        mean = stack.astype(np.float64).mean(axis=0)
        out: dict[str, Any] = {
            "accuracy": float(acc.mean()), "accuracy_min": float(acc.min()),
            "accuracy_max": float(acc.max()), "loss": float(loss.mean()),
            "consensus_distance": float(np.sqrt(((stack - mean) ** 2).sum(axis=1).mean())),
        }
        if self.attack_pair is not None:
            src, dst = self.attack_pair
            mask = test.y == src
            x_src = test.x[mask]
            y_dst = np.full(int(mask.sum()), dst, dtype=np.int64)
            flipped, _ = evaluate_many(self.data.task.model_factory, self.spec, stack, x_src,
                                       y_dst)
            out["attack_success"] = float(flipped.mean())
        return out

    def run(self) -> GossipResult:
        threads = self.sim.threads or default_workers()
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            for r in range(self.gossip.rounds):
                row = self.step(r)
                self.rows.append(row)
                if self.recorder is not None:
                    self.recorder.record(row)
                if self.progress is not None and "accuracy" in row:
                    self.progress(row)
        finally:
            torch.set_num_threads(previous)
            self.executor.close()
        wall = time.perf_counter() - t0
        rounds = max(len(self.rows), 1)
        per_peer = self.bytes_sent / rounds / max(len(self.nodes), 1)
        last = self.rows[-1] if self.rows else {}
        extra = {"wall_s": wall, "virtual_s": self.time_s, "peers": len(self.nodes),
                 "rounds": len(self.rows), "bytes_per_peer_round": per_peer,
                 "updates": self.updates_sent,
                 "push_bytes": self.push_bytes,
                 "final_accuracy_min": last.get("accuracy_min"),
                 "final_consensus_distance": last.get("consensus_distance")}
        summary = (self.recorder.finish(extra) if self.recorder is not None
                   else {"final_accuracy": last.get("accuracy"), **extra})
        return GossipResult(self.rows, np.stack([n.model for n in self.nodes]), summary, wall,
                            self.time_s, per_peer)


def simulate_gossip(task: TaskConfig | None = None, gossip: GossipConfig | None = None,
                    sim: SimulationConfig | None = None, **kwargs: Any) -> GossipResult:
    """Simulate gossip learning: ``murmura simulate --gossip`` from Python."""
    return GossipSimulation(task or TaskConfig(), gossip or GossipConfig(),
                            sim or SimulationConfig(), **kwargs).run()
