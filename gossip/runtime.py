"""The peer loop: join through any bootstrap peer, then train, send, wait, mix, shuffle.

:class:`PeerRuntime` mirrors :class:`~murmura.client.ClientRuntime` for gossip mode: a
transport and a trainer in, a loop that survives other peers joining, leaving and crashing.
Its decisions (whom to send to, what to accept, how to mix) are :class:`PeerNode`'s, shared
with the simulator. Sends run in the background with retries and backoff; a peer that stays
unreachable is dropped from the view and not re-added from other peers' stale entries until it
contacts this peer itself (or comes back at a new address).

Joining and catching up are :mod:`murmura.gossip.joining`; what the peer answers to other
peers (shuffles, model pushes, pulls, health, goodbyes) is :mod:`murmura.gossip.answers`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from murmura.client import RemoteError, RetryPolicy, Trainer
from murmura.gossip.answers import PeerAnswers, _push_fields
from murmura.gossip.config import GossipConfig
from murmura.gossip.identity import AddressBinding
from murmura.gossip.joining import PeerJoining
from murmura.gossip.modest import ModestRounds
from murmura.gossip.node import PeerNode, training_seed
from murmura.gossip.transport import PeerTransport
from murmura.protocols import FlatVector, ModelSpec, PeerInfo, PeerModelHeader
from murmura.protocols.identity import NodeKey, peer_message

log = logging.getLogger(__name__)

__all__ = ["PeerRuntime", "PeerStats", "RoundReport"]

UpdateHook = Callable[[FlatVector], FlatVector]


@dataclass
class PeerStats:
    rounds: int = 0
    sent: int = 0
    send_failures: int = 0
    received: int = 0
    refused: int = 0
    mixed: int = 0
    retries: int = 0
    catch_up_bytes: int = 0  # seed mode: step logs (and a snapshot, if pulled) replayed
    refusals: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RoundReport:
    """What a peer did in one round (the CLI evaluates ``model`` and writes a metrics row)."""

    round: int
    model: FlatVector
    mixed: int
    view: int
    bytes_sent: int
    train_loss: float
    time_s: float


class PeerRuntime(PeerJoining, PeerAnswers):
    """One peer identity driving a :class:`PeerNode` over a :class:`PeerTransport`.

    ``model`` is the starting model every peer of a run shares (default: the trainer's
    module). ``catch_up`` makes a joining or restarted peer pull the model of the most
    advanced peer it learns of and continue from that peer's round. ``update_hook`` changes
    the update (trained minus starting model) before it is sent and kept: the red-team attacks
    of :mod:`murmura.client.attacks` plug in here.
    """

    def __init__(self, transport: PeerTransport, trainer: Trainer, *, peer_id: str,
                 config: GossipConfig | None = None, bootstrap: Sequence[str] = (),
                 model: FlatVector | None = None, catch_up: bool = False,
                 retry: RetryPolicy | None = None,
                 on_round: Callable[[RoundReport], None] | None = None,
                 update_hook: UpdateHook | None = None, key: NodeKey | None = None,
                 num_peers: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.transport, self.trainer, self.peer_id = transport, trainer, peer_id
        self.config = config or GossipConfig()
        self.settings = self.config.settings()
        self.bootstrap = [b for b in bootstrap if b]
        self.catch_up = catch_up
        self.retry = retry or RetryPolicy(initial_s=0.05, max_s=1.0, give_up_after_s=30.0)
        #: A model send gives up within a round's wait (the neighbours mix without it then).
        self._send_retry = dataclasses.replace(
            self.retry, give_up_after_s=max(self.config.round_timeout_s, 0.5))
        self.on_round, self.update_hook, self.clock = on_round, update_hook, clock
        self.spec: ModelSpec = trainer.spec
        if model is None:
            module = getattr(trainer, "model", None)
            if module is None:
                raise ValueError("pass model= (the run's starting model) for this trainer")
            model = self.spec.flatten(module)
        self.node = PeerNode(peer_id, self.spec, self.config, model, num_peers=num_peers)
        self.key = key
        if key is not None:
            self.node.public_key = key.public_bytes
        self.identity = AddressBinding(peer_id, is_alive=self._alive,
                                       require_signatures=self.config.require_signatures)
        self.stats = PeerStats()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._training = False
        self._rand = random.Random(f"{peer_id}:{self.config.seed}")
        # the backoffs' jitter: its own stream, so a retry (timing) never moves the shuffles'
        self._jitter = random.Random(f"backoff:{peer_id}:{self.config.seed}")
        self._sender = ThreadPoolExecutor(max(4, 2 * self.config.fanout_for(
            self.config.view_size)), thread_name_prefix=f"send-{peer_id}")
        self._started = 0.0
        self._early: list[tuple[PeerModelHeader, bytes]] = []  # seed mode: logs ahead of us
        self._end = self.config.rounds
        self.modest = ModestRounds(self) if self.config.topology == "modest" else None

    # -- lifecycle

    @property
    def address(self) -> str:
        return self.node.address

    def start(self) -> str:
        """Serve the Peer service and join through the bootstrap peers; return the address."""
        self._started = self.clock()
        self.node.address = self.transport.serve(self)
        log.info("peer %s listening on %s", self.peer_id, self.node.address)
        self._join()
        return self.node.address

    def _await_peers(self) -> None:
        """Before round 0, shuffle until ``min_peers`` peers are known (or the start timeout):
        a run whose peers start together then begins with full views."""
        need = min(self.config.min_peers - 1, self.config.view_size)
        deadline = self.clock() + self.config.start_timeout_s
        while not self._stop.is_set() and self.clock() < deadline:
            with self._lock:
                if len(self.node.view) >= need:
                    return
            self._shuffle(tick=False)
            self._stop.wait(0.05)

    def stop(self) -> None:
        """Ask the loop to end after the current round (then it says goodbye)."""
        self._stop.set()
        with self._arrived:
            self._arrived.notify_all()

    def run(self, *, rounds: int | None = None) -> PeerStats:
        """Train ``rounds`` rounds (default: the config's), say goodbye, stop serving."""
        if not self.node.address:
            self.start()
        end = self._end = self.config.rounds if rounds is None else rounds
        try:
            if self.node.round == 0:
                self._await_peers()
            if self.modest is not None:
                self.modest.run(end)
            while self.modest is None and self.node.round < end and not self._stop.is_set():
                self.step()
        finally:
            self.close()
        return self.stats

    def close(self) -> None:
        """Finish the last round's sends, say goodbye to the view (best effort), then stop
        serving."""
        self._sender.shutdown(wait=True)  # a send gives up after its retry budget
        with self._lock:
            me, entries = self.node.me(), self.node.view.entries()
        for e in entries:
            try:
                self.transport.goodbye(e.address, me, signature=self._sign("goodbye", me))
            except RemoteError:
                pass
        self.transport.stop()

    # -- one round

    def step(self) -> RoundReport:
        """Train, send to this round's targets, wait for neighbours, mix, shuffle."""
        seed_mode = self.config.seed_mode
        with self._lock:
            r = self.node.round
            base = self.node.model.copy()
            if seed_mode:
                self.node.start_round(r)
            self._training = True
        if seed_mode:
            self._replay_early(r)
        result = self.trainer.train(base, self.settings,
                                    seed=training_seed(self.config.seed, self.peer_id, r))
        assert result.params is not None, "gossip peers need trainers that return models"
        new = result.params
        codec, payload = "dense-f32", b""
        if seed_mode:
            if result.encoded is None or result.encoded[0] != "seed":
                raise ValueError("seed mode needs the zeroth-order trainer (ZOTrainer)")
            codec, payload = result.encoded
        else:
            new = self.hooked(base, new)
        with self._lock:
            self._training = False
            self.node.model = new
            self.node.own_examples = result.num_examples
            if seed_mode:  # the same arithmetic as a receiver's replay: bit-identical
                self.node.own_update = np.subtract(new, base, dtype=np.float32)
                self.node.own_payload = bytes(payload)
            targets = [(t, self.node.view.get(t)) for t in self.node.targets(r)]
            me = self.node.me()
        if not seed_mode:
            payload = new.tobytes()
        for target, entry in targets:
            if entry is not None:
                self._sender.submit(self._send, target, entry.address, me, r, payload,
                                    result.num_examples, codec)
        deadline = self.clock() + self.config.round_timeout_s
        with self._arrived:
            while not self._stop.is_set() and self.node.ready(r) < self.node.expected():
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._arrived.wait(left)
            mixed = self.node.mix()
            self.node.advance(r)
            model = self.node.model.copy()
            view = len(self.node.view)
        self.stats.rounds += 1
        self.stats.mixed += mixed
        self._shuffle()
        report = self.report(r, model, mixed, view,
                             float(result.metrics.get("train_loss", float("nan"))))
        if self.on_round is not None:
            self.on_round(report)
        return report

    def hooked(self, base: FlatVector, trained: FlatVector) -> FlatVector:
        """``trained`` after :attr:`update_hook` (applied to the update from ``base``)."""
        if self.update_hook is None:
            return trained
        return (base + self.update_hook(np.subtract(trained, base, dtype=np.float32))
                ).astype(np.float32)

    def report(self, round_: int, model: FlatVector, mixed: int, view: int | None = None,
               train_loss: float = float("nan")) -> RoundReport:
        """What this peer did in ``round_``, for :attr:`on_round`."""
        if view is None:
            with self._lock:
                view = len(self.node.view)
        return RoundReport(round_, model, mixed, view, self.transport.bytes_sent, train_loss,
                           self.clock() - self._started)

    def _send(self, target: str, address: str, me: PeerInfo, round_: int, payload: bytes,
              num_examples: int, codec: str = "dense-f32", kind: str = "") -> bool:
        """Push with retries and backoff; True once the target took it (or had it)."""
        message_id = secrets.token_urlsafe(9)
        header = PeerModelHeader(sender=me, message_id=message_id, round=round_,
                                 num_examples=num_examples, codec=codec,
                                 payload_bytes=len(payload),
                                 spec_fingerprint=self.node.fingerprint,
                                 signature=self._sign("push", me, *_push_fields(
                                     message_id, round_, num_examples, codec,
                                     self.node.fingerprint, payload, kind)), kind=kind)
        backoff = self._send_retry.start(self.clock(), self._jitter)
        while not self._stop.is_set():
            try:
                self.transport.push_model(address, header, payload)
                self.stats.sent += 1
                return True
            except RemoteError as exc:
                pause = backoff.next_pause(self.clock(), exc.retry_after_s) if exc.retryable \
                    else None
                if pause is None:
                    log.info("%s: sending round %d to %s failed: %s", self.peer_id, round_,
                             target, exc)
                    self.stats.send_failures += 1
                    if exc.retryable:
                        self._mark_dead(target, address)
                    else:
                        self.stats.refusals.append(exc.status)
                        log.warning("%s refused our model: %s", target, exc)
                    return False
                self.stats.retries += 1
                self._stop.wait(pause)
        return False

    def _mark_dead(self, peer_id: str, address: str) -> None:
        log.info("%s: peer %s at %s is unreachable; dropping it from the view", self.peer_id,
                 peer_id, address)
        with self._lock:
            self.node.mark_dead(peer_id, address)

    def _shuffle(self, *, tick: bool = True) -> None:
        with self._lock:
            if tick:
                partner, offer = self.node.shuffle_start()
            else:  # before the first round: any member, so a new peer learns from several
                entries = self.node.view.entries()
                partner = self._rand.choice(entries) if entries else None
                offer = self.node.view.sample(self.config.shuffle_size)
            if partner is None:
                return
            me = self.node.me()
            history = self.node.history_offer(self._rand)
        try:
            sender, peers, theirs = self.transport.exchange(
                partner.address, me, offer, self.node.fingerprint, history,
                signature=self._sign("exchange", me, self.node.fingerprint))
        except RemoteError as exc:
            if exc.retryable:
                self._mark_dead(partner.peer_id, partner.address)
            return
        with self._lock:
            self.node.heard_from(PeerInfo(sender.peer_id, partner.address, sender.round, 0))
            self.node.merge(peers)
            self.node.take_history(theirs)

    def _sign(self, kind: str, me: PeerInfo, *parts: bytes | str | int) -> bytes:
        """This peer's signature of a message (empty for a peer without a key)."""
        if self.key is None:
            return b""
        return self.key.sign(peer_message(kind, me.peer_id, me.address, me.public_key, *parts))

    def _alive(self, peer_id: str, address: str) -> bool:
        try:
            return self.transport.health(address).peer_id == peer_id
        except RemoteError:
            return False
