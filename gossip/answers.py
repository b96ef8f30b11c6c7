"""What a gossip peer answers: the Peer service's side of a
:class:`~murmura.gossip.runtime.PeerRuntime`.

These handlers run on the transport's server threads, concurrently with the peer's own loop
(:mod:`murmura.gossip.runtime`), and share its state under its lock. They answer a shuffle,
check a model push by its header and then take it (its signature checked, decoded, kept for
its round; a seed-mode step log for a round not started yet waits for it; a MoDeST model
goes to the relay), serve pulls of the model or the step logs, a health probe and a goodbye.
They are kept apart from the loop because they are the peer's attack surface: every input
here comes from the network and is refused with a :mod:`~murmura.gossip.errors` status when
it is wrong.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from murmura.gossip.config import GossipConfig
from murmura.gossip.errors import (
    Aborted,
    FailedPrecondition,
    GossipError,
    InvalidArgument,
    Unavailable,
    quote,
)
from murmura.gossip.identity import AddressBinding, check_well_formed
from murmura.gossip.journal import RoundLogs, StepJournal, digest
from murmura.gossip.node import PeerNode
from murmura.gossip.transport import Health, HistoryRecord, PeerHandler
from murmura.protocols import (
    CodecError,
    FlatVector,
    ModelSpec,
    PeerInfo,
    PeerModelHeader,
    UnknownCodecError,
    create_codec,
)
from murmura.protocols.identity import payload_digest, peer_message

if TYPE_CHECKING:
    from murmura.gossip.modest import ModestRounds
    from murmura.gossip.runtime import PeerStats

log = logging.getLogger(__name__)


def _push_fields(message_id: str, round_: int, num_examples: int, codec: str, fingerprint: str,
                 payload: bytes | memoryview, kind: str = "") -> tuple[str | int | bytes, ...]:
    """The fields of a model push a signature covers, the payload by its SHA-256 (and the
    MoDeST kind, when there is one)."""
    fields: tuple[str | int | bytes, ...] = (message_id, round_, num_examples, codec,
                                             fingerprint, payload_digest(payload))
    return (*fields, kind) if kind else fields


class PeerAnswers(PeerHandler):
    """The :class:`PeerHandler` of a peer (mixed into
    :class:`~murmura.gossip.runtime.PeerRuntime`, whose ``__init__`` sets the state below)."""

    peer_id: str
    config: GossipConfig
    spec: ModelSpec
    node: PeerNode
    identity: AddressBinding
    modest: ModestRounds | None
    stats: PeerStats
    _lock: threading.Lock
    _arrived: threading.Condition
    _stop: threading.Event
    _rand: random.Random
    _early: list[tuple[PeerModelHeader, bytes]]
    _end: int
    _training: bool

    def on_exchange(self, sender: PeerInfo, peers: Sequence[PeerInfo], fingerprint: str,
                    signature: bytes, history: Sequence[HistoryRecord] = ()
                    ) -> tuple[PeerInfo, list[PeerInfo], list[HistoryRecord]]:
        if fingerprint != self.node.fingerprint:
            raise FailedPrecondition(f"model spec {quote(fingerprint, 24)} differs from this "
                                     f"peer's {self.node.fingerprint}")
        self.identity.check(sender.peer_id, sender.address, public_key=sender.public_key,
                            signature=signature, message=peer_message(
                                "exchange", sender.peer_id, sender.address, sender.public_key,
                                fingerprint))
        with self._lock:
            reply = self.node.shuffle_answer(sender, peers)
            mine = self.node.history_offer(self._rand)
            self.node.take_history(history)
            return self.node.me(), reply, mine

    def check_header(self, header: PeerModelHeader) -> int:
        # a signature covers the payload: checked in on_model, once the payload is in; an
        # unsigned id is bound only once its model is taken (a refused push binds nothing)
        self.identity.check(header.sender.peer_id, header.sender.address,
                            public_key=header.sender.public_key, signature=None, bind=False)
        try:
            codec = create_codec(header.codec)
        except (UnknownCodecError, CodecError):
            raise InvalidArgument(f"unknown codec {quote(header.codec)}") from None
        if codec.needs_reference and not (self.config.seed_mode and header.codec == "seed"):
            raise InvalidArgument(f"codec {header.codec!r} needs a reference model; this peer "
                                  f"takes whole models" + ("" if self.config.seed_mode
                                                          else " (seed mode is off)"))
        if self.config.seed_mode and header.codec != "seed":
            raise InvalidArgument(f"this peer runs seed mode and takes codec 'seed' only, got "
                                  f"{quote(header.codec)}")
        with self._lock:
            self.node.check_model(header.sender.peer_id, header.round, header.num_examples,
                                  header.spec_fingerprint)
        return codec.max_payload_bytes(self.spec.size) or 4 * self.spec.size + 4096

    def on_model(self, header: PeerModelHeader, payload: bytes | memoryview) -> tuple[bool, int]:
        sender = header.sender
        if sender.public_key:
            self.identity.check(sender.peer_id, sender.address, public_key=sender.public_key,
                                signature=header.signature, message=peer_message(
                                    "push", sender.peer_id, sender.address, sender.public_key,
                                    *_push_fields(header.message_id, header.round,
                                                  header.num_examples, header.codec,
                                                  header.spec_fingerprint, payload,
                                                  header.kind)))
        if self.modest is not None or header.kind:
            return self._take_modest(header, payload)
        try:
            codec = create_codec(header.codec)
            if codec.needs_reference:  # seed mode: replay the step log on the round's base
                with self._lock:
                    if header.round > self.node.round and header.round not in self.node.bases:
                        # a log for a round this peer has not started: replayed when it does
                        if len(self._early) >= 8 * self.config.view_size:
                            raise Aborted("too many step logs for future rounds; retry later")
                        self._early.append((header, bytes(payload)))
                        return True, self.node.round
                    reference = self.node.base(header.round)
                model = codec.decode(payload, self.spec.size, reference=reference)
                return self._take(header, model, bytes(payload))
            model = codec.decode(payload, self.spec.size)
        except CodecError as exc:
            raise InvalidArgument(f"model payload does not decode: {str(exc)[:80]}") from None
        return self._take(header, model)

    def _take_modest(self, header: PeerModelHeader, payload: bytes | memoryview
                     ) -> tuple[bool, int]:
        """A MoDeST trained model or aggregate: decoded, checked, kept for its round."""
        if self.modest is None:
            raise InvalidArgument(f"kind {quote(header.kind)} belongs to topology 'modest'; "
                                  f"this peer runs {self.config.topology!r}")
        if header.codec != "dense-f32":
            raise InvalidArgument(f"a modest run moves whole models (codec 'dense-f32'), got "
                                  f"{quote(header.codec)}")
        try:
            model = create_codec(header.codec).decode(payload, self.spec.size)
        except CodecError as exc:
            raise InvalidArgument(f"model payload does not decode: {str(exc)[:80]}") from None
        if model.shape != (self.spec.size,):
            raise InvalidArgument(f"model has {model.size} values, expected {self.spec.size}")
        if not np.isfinite(model).all():
            raise InvalidArgument("model has non-finite values (NaN or infinity)")
        with self._arrived:
            taken = self.modest.accept(header.sender.peer_id, header.kind, header.round,
                                       header.message_id, model, header.num_examples,
                                       self._end)
            self.stats.received += int(taken)
            self.node.heard_from(header.sender)
            round_ = self.node.round
        if not header.sender.public_key:
            self.identity.bind(header.sender.peer_id, header.sender.address)
        return taken, round_

    def _replay_early(self, round_: int) -> None:
        """Seed mode, at the start of ``round_``: replay the step logs that came early."""
        with self._lock:
            due = [(h, p) for h, p in self._early if h.round == round_]
            self._early = [(h, p) for h, p in self._early if h.round > round_]
            reference = self.node.base(round_)
        codec = create_codec("seed")
        for header, payload in due:
            try:
                model = codec.decode(payload, self.spec.size, reference=reference)
                self._take(header, model, payload)
            except (CodecError, GossipError) as exc:
                log.warning("%s: an early step log from %s was refused: %s", self.peer_id,
                            header.sender.peer_id, exc)

    def _take(self, header: PeerModelHeader, model: FlatVector,
              payload: bytes = b"") -> tuple[bool, int]:
        with self._arrived:
            taken = self.node.receive(header.sender.peer_id, header.round, header.message_id,
                                      model, header.num_examples, header.spec_fingerprint,
                                      payload=payload)
            self.stats.received += int(taken)
            self._arrived.notify_all()
            round_ = self.node.round
            self.node.heard_from(header.sender)
        if not header.sender.public_key:
            self.identity.bind(header.sender.peer_id, header.sender.address)
        return taken, round_

    def on_pull(self, peer_id: str, snapshot: bool = False
                ) -> tuple[int, ModelSpec, FlatVector]:
        if self._stop.is_set():
            raise Unavailable("this peer is leaving")
        with self._lock:
            if snapshot:
                journal = self._journal()
                return journal.snapshot_round, self.spec, journal.snapshot.copy()
            return self.node.round, self.spec, self.node.model.copy()

    def on_step_logs(self, peer_id: str) -> tuple[int, bytes, list[RoundLogs]]:
        if self._stop.is_set():
            raise Unavailable("this peer is leaving")
        with self._lock:
            journal = self._journal()
            return journal.snapshot_round, digest(journal.snapshot), journal.entries()

    def _journal(self) -> StepJournal:
        if self.node.journal is None:
            raise FailedPrecondition("this peer does not run seed mode: it keeps no step logs")
        return self.node.journal

    def on_health(self) -> Health:
        with self._lock:
            return Health(self.peer_id, self.node.round, len(self.node.view), self._training)

    def on_goodbye(self, sender: PeerInfo, signature: bytes = b"") -> None:
        check_well_formed(sender.peer_id, sender.address)
        if sender.public_key:  # a signed goodbye: only the key bound to the id may say it
            self.identity.check(sender.peer_id, sender.address, public_key=sender.public_key,
                                signature=signature, message=peer_message(
                                    "goodbye", sender.peer_id, sender.address,
                                    sender.public_key))
        elif self.identity.key_of(sender.peer_id) is not None:
            return  # an unsigned goodbye for a signing peer: ignored
        if self.identity.address_of(sender.peer_id) not in (None, sender.address):
            return  # only the bound address may say goodbye for an id
        with self._lock:
            self.node.mark_dead(sender.peer_id, sender.address)
