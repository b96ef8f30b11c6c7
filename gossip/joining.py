"""How a gossip peer joins: through any bootstrap peer, then, when asked to, by catching up
with the most advanced peer it learns of.

A joining or restarted peer pulls that peer's model and round, or in seed mode replays its
step logs on a snapshot (the run's starting model when the journal still begins there, so a
peer that holds it downloads only the logs). This runs once, before the first round, and is
kept apart from the round loop (:mod:`murmura.gossip.runtime`) whose state it shares:
:class:`PeerJoining` is mixed into :class:`~murmura.gossip.runtime.PeerRuntime`.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from murmura.client import RemoteError, RetryPolicy
from murmura.gossip.journal import digest, replay
from murmura.gossip.node import PeerNode
from murmura.gossip.transport import PeerTransport
from murmura.protocols import CodecError, ModelSpec, PeerInfo

if TYPE_CHECKING:
    from murmura.gossip.runtime import PeerStats

log = logging.getLogger(__name__)


class PeerJoining:
    """Joining and catching up (mixed into :class:`~murmura.gossip.runtime.PeerRuntime`,
    whose ``__init__`` sets the state below)."""

    peer_id: str
    transport: PeerTransport
    spec: ModelSpec
    node: PeerNode
    bootstrap: list[str]
    catch_up: bool
    retry: RetryPolicy
    clock: Callable[[], float]
    stats: PeerStats
    _lock: threading.Lock
    _stop: threading.Event
    _jitter: random.Random

    if TYPE_CHECKING:  # the runtime's signing
        def _sign(self, kind: str, me: PeerInfo, *parts: bytes | str | int) -> bytes: ...

    def _join(self) -> None:
        if not self.bootstrap:
            return
        joined = False
        backoff = self.retry.start(self.clock(), self._jitter)
        while not joined:
            hints: list[float] = []  # the busy bootstrap peers' retry hints
            for address in self.bootstrap:
                try:
                    me = self.node.me()
                    sender, peers, _ = self.transport.exchange(
                        address, me, [], self.node.fingerprint,
                        signature=self._sign("exchange", me, self.node.fingerprint))
                except RemoteError as exc:
                    if not exc.retryable:
                        raise
                    if exc.retry_after_s is not None:
                        hints.append(exc.retry_after_s)
                    continue
                with self._lock:
                    self.node.merge([PeerInfo(sender.peer_id, address, sender.round, 0),
                                     *peers])
                joined = True
            if not joined:
                # the soonest a busy bootstrap peer asked for; none when one was simply away
                hint = min(hints) if len(hints) == len(self.bootstrap) else None
                pause = backoff.next_pause(self.clock(), hint)
                if pause is None:
                    raise RemoteError("UNAVAILABLE", f"no bootstrap peer answered: "
                                                     f"{', '.join(self.bootstrap)[:80]}")
                self.stats.retries += 1
                self._stop.wait(pause)
        if self.catch_up:
            self._catch_up()

    def _catch_up(self) -> None:
        """Continue from the most advanced known peer's model and round: in seed mode by
        replaying its step logs on a snapshot (the run's starting model when the journal
        still begins there, which this peer holds), else by pulling its model."""
        with self._lock:
            entries = sorted(self.node.view.entries(), key=lambda e: (-e.round, e.peer_id))
        for e in entries:
            if self.node.journal is not None and self._catch_up_by_replay(e.address,
                                                                          e.peer_id):
                return
            try:
                round_, model = self.transport.pull_model(e.address, self.peer_id)
                self.spec.check_vector(model)
            except (RemoteError, ValueError) as exc:
                log.info("catch-up from %s failed: %s", e.peer_id, exc)
                continue
            if not np.isfinite(model).all():
                continue
            with self._lock:
                self.node.model = model
                self.node.round = max(self.node.round, int(round_))
                if self.node.journal is not None:
                    self.node.journal.rebase(self.node.round, model)
            log.info("%s caught up from %s at round %d", self.peer_id, e.peer_id, round_)
            return

    def _catch_up_by_replay(self, address: str, peer_id: str) -> bool:
        """Seed mode: the peer's snapshot (pulled only if this peer lacks it) and its step
        logs since, replayed here. False (and nothing changed) when anything fails."""
        journal = self.node.journal
        assert journal is not None
        try:
            snapshot_round, sha, rounds = self.transport.pull_step_logs(address, self.peer_id)
            with self._lock:
                own = self.node.model.copy()
            pulled = 0
            if digest(own) == sha:
                snapshot = own
            else:
                r, snapshot = self.transport.pull_model(address, self.peer_id, snapshot=True)
                self.spec.check_vector(snapshot)
                if r != snapshot_round or digest(snapshot) != sha:
                    raise ValueError("the snapshot changed between the two pulls")
                pulled = snapshot.nbytes
            model = replay(snapshot, rounds, journal.decode)
            if not np.isfinite(model).all():
                raise ValueError("the replayed model is not finite")
        except (RemoteError, ValueError, CodecError) as exc:
            log.info("catch-up by replay from %s failed: %s", peer_id, str(exc)[:120])
            return False
        next_round = rounds[-1][0] + 1 if rounds else snapshot_round
        with self._lock:
            self.node.model = model
            self.node.round = max(self.node.round, next_round)
            journal.adopt(snapshot_round, snapshot, rounds)
        self.stats.catch_up_bytes = pulled + sum(len(p) for _, logs in rounds for _, p in logs)
        log.info("%s caught up from %s at round %d by replaying %d rounds of step logs "
                 "(%d bytes%s)", self.peer_id, peer_id, next_round, len(rounds),
                 self.stats.catch_up_bytes, ", snapshot included" if pulled else "")
        return True
