"""Sessions and identities: the aggregator's job of knowing who is taking part.

Join (with its challenge and the proof of a node key), leave, session lookup, expiry of
unused sessions and of clients whose waiting call was cancelled, and dropping a silent client.
:class:`~murmura.server.core.AggregatorCore` takes these methods from :class:`SessionsJob`;
they run on the core's owner thread and change only the session registry (and, durably,
the session rows).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from murmura.protocols import (
    PROTOCOL_VERSION,
    DeviceProfile,
    JoinProof,
    JoinResult,
)
from murmura.protocols.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    IdentityError,
    check_public_key,
    client_id_for,
    join_message,
    verify,
)
from murmura.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
)
from murmura.server.limits import (
    MAX_ID,
    MAX_TOKEN,
    check_profile,
    check_session,
    check_text,
    quote,
)
from murmura.server.state import (
    EndSession,
    SaveSession,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

#: Join challenges: how long a nonce stays valid, and how many may be outstanding (the oldest
#: gives way to a new one, so a flood of Challenge calls cannot grow memory).
CHALLENGE_TTL_S = 60.0
MAX_CHALLENGES = 10_000
NONCE_BYTES = 32
#: A client whose waiting call was cancelled from its side (its process exited, its
#: connection broke) and that makes no call within this many seconds has gone: its session
#: ends. A live client retries a failed call sooner (its backoff starts at 0.2 s).
LOST_GRACE_S = 1.0


@dataclass
class ClientRecord:
    session: str
    client_id: str
    profile: DeviceProfile
    joined_at: float
    updates: int = 0
    last_seen: float = 0.0
    #: The Ed25519 key the client proved at Join (empty when the server takes no identities).
    public_key: bytes = b""


class SessionsJob:
    """Who takes part: the session registry's methods (mixed into the core)."""

    #: attributes this job assigns (declared in AggregatorCore.__init__)
    last_durable: Future[Any] | None

    if TYPE_CHECKING:  # the core's state, typed where AggregatorCore declares it
        def __getattr__(self, name: str) -> Any: ...


    def active_client_ids(self) -> list[str]:
        return list(self._session_of)

    def _record(self, session: str) -> ClientRecord:
        """The session's client, which is now seen (it expires ``session_ttl_s`` later)."""
        check_session(session)
        rec = self.sessions.get(session)
        if rec is None:
            if session in self._left:
                raise Unauthenticated(f"session {session[:8]}… of client "
                                      f"{quote(self._left[session])} has ended (it left or "
                                      f"expired); join again", reason="session ended")
            raise Unauthenticated("unknown session; call Join first", reason="unknown session")
        rec.last_seen = self.clock()
        self._last_seen.pop(session, None)
        self._last_seen[session] = rec.last_seen
        if self._lost:
            self._lost.pop(session, None)
        return rec

    def record_of(self, client_id: str) -> ClientRecord | None:
        """The open session's record of ``client_id`` (not marked as seen)."""
        session = self._session_of.get(client_id)
        return None if session is None else self.sessions.get(session)

    def drop_client(self, rec: ClientRecord, why: str) -> None:
        """End a client's session without its asking (a policy found it dead): its next call
        is told to join again, so a client that was only slow comes back."""
        if self.sessions.get(rec.session) is not rec:
            return
        self._end_session(rec.session, rec, forget=False)
        log.info("client %s taken for gone: %s; its session ends", rec.client_id, why)
        self._changed()

    def lost_contact(self, session: str) -> None:
        """The transport saw the client's waiting call cancelled from the client's side; unless
        the client calls again within LOST_GRACE_S, its session ends (see :meth:`tick`)."""
        if session in self.sessions:
            self._lost[session] = self.clock()

    def _end_session(self, session: str, rec: ClientRecord, *,
                     forget: bool = True) -> None:
        """``forget``: the client left for good (its measurements go too)."""
        del self.sessions[session]
        self._last_seen.pop(session, None)
        self._lost.pop(session, None)
        if self._session_of.get(rec.client_id) == session:
            del self._session_of[rec.client_id]
        self._left[session] = rec.client_id
        if self.store is not None:
            self._durable(EndSession(session))
        self.policy.on_leave(rec)
        if forget:
            self.policy.forget(rec.client_id)

    def expire_sessions(self, now: float) -> int:
        """End the sessions unused for ``session_ttl_s``; how many ended."""
        ttl = self.config.security.session_ttl_s
        if not ttl:
            return 0
        ended = 0
        while self._last_seen:
            session, seen = next(iter(self._last_seen.items()))
            if now - seen < ttl:
                break
            self._last_seen.popitem(last=False)
            rec = self.sessions.get(session)
            if rec is not None:
                self._end_session(session, rec)
                log.info("session of client %s expired after %.0f s unused", rec.client_id,
                         now - seen)
                ended += 1
        if ended:
            self._changed()
        return ended

    def challenge(self) -> tuple[bytes, float]:
        """A single-use nonce for :meth:`join` and how many seconds it stays valid."""
        now = self.clock()
        while self._challenges and next(iter(self._challenges.values())) <= now:
            self._challenges.popitem(last=False)  # expired
        while len(self._challenges) >= MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._challenges[nonce] = now + CHALLENGE_TTL_S
        return nonce, CHALLENGE_TTL_S

    def join(self, client_id: str, profile: DeviceProfile, *, token: str = "",
             protocol_version: int = PROTOCOL_VERSION, proof: JoinProof | None = None
             ) -> JoinResult:
        """Open a session for ``client_id``. With ``require_identity`` the client must send a
        ``proof`` that it holds the key its id derives from (see protocols/identity.py); a
        Join for an id whose session is open ends that session only if it proves the same key
        (a restarted client), so nobody else can take an identity over."""
        try:
            return self._join(client_id, profile, token, protocol_version, proof)
        except ServiceError as exc:
            self.count_refusal(exc)
            raise

    def _join(self, client_id: str, profile: DeviceProfile, token: str,
              protocol_version: int, proof: JoinProof | None) -> JoinResult:
        check_text("client_id", client_id, MAX_ID)
        check_text("token", token, MAX_TOKEN, allow_empty=True)
        check_profile(profile)
        if protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(f"client speaks protocol {protocol_version}; this server "
                                     f"speaks {PROTOCOL_VERSION}")
        expected = self.config.security.join_token
        if expected and not hmac.compare_digest(token.encode(), expected.encode()):
            raise PermissionDenied("join token is missing or wrong")
        public_key = b""
        if proof is not None and (proof.public_key or proof.signature or proof.nonce):
            public_key = self._check_proof(client_id, proof)
        elif self.config.security.require_identity:
            raise Unauthenticated("this server requires a node identity: sign a Challenge nonce "
                                  "with an Ed25519 key (clients make one unless given --key)")
        if profile.device == "leaf" and self.config.security.require_identity \
                and public_key not in self.leaf_keys:  # refused now, not at its first push
            raise PermissionDenied(
                f"leaf {quote(client_id)} is not registered here: add its key (the .pub of the "
                f"leaf's --key FILE) to this server's --leaf-keys")
        # After the proof: nobody can spend another identity's join budget.
        now = self.clock()
        wait = self._join_limit.allow(client_id, now)
        if wait:
            raise ResourceExhausted(f"client {quote(client_id)} joins too often (at most "
                                    f"{self.config.security.join_per_s:g} per second)",
                                    retry_after_s=wait)
        old = self._session_of.get(client_id)
        if old is not None:  # a restarted client takes over its identity
            previous = self.sessions.get(old)
            if previous is not None and previous.public_key != public_key:
                raise PermissionDenied(f"client id {client_id[:40]!r} is held by another key")
            self.sessions.pop(old, None)
            self._last_seen.pop(old, None)
        elif len(self.sessions) >= self.config.security.max_sessions:
            self.expire_sessions(now)
            if len(self.sessions) >= self.config.security.max_sessions:
                raise ResourceExhausted(f"the server holds its maximum of "
                                        f"{self.config.security.max_sessions} sessions; try later",
                                        retry_after_s=30.0)
        session = secrets.token_urlsafe(16)  # 128 bits in 22 characters
        self.sessions[session] = ClientRecord(session, client_id, profile, now, last_seen=now,
                                              public_key=public_key)
        self._last_seen[session] = now
        self._session_of[client_id] = session
        self.telemetry.joined(self.sessions[session])
        self.last_durable = None
        if self.store is not None:
            self._durable(SaveSession(session, client_id, dataclasses.asdict(profile),
                                      time.time(), public_key=public_key, replaces=old))
        if old is None:
            log.info("client %s joined (%s)", client_id, profile.device)
        else:  # a restart, a lost session, or a leaf's link after its settings join
            log.info("client %s joined again (%s); its previous session is replaced",
                     client_id, profile.device)
        self._changed()
        return JoinResult(session=session, settings=self.config.train, mode=self.config.mode,
                          max_payload_bytes=self.config.security.max_payload_bytes,
                          secagg=self.config.privacy.secagg_params())

    def _check_proof(self, client_id: str, proof: JoinProof) -> bytes:
        """The proven public key, or a refusal saying which part of the proof is wrong."""
        expires = self._challenges.pop(bytes(proof.nonce), None)  # single use, also on failure
        if len(proof.public_key) != PUBLIC_KEY_BYTES or len(proof.signature) != SIGNATURE_BYTES:
            raise InvalidArgument(f"join proof needs a {PUBLIC_KEY_BYTES}-byte Ed25519 public key "
                                  f"and a {SIGNATURE_BYTES}-byte signature, got "
                                  f"{len(proof.public_key)} and {len(proof.signature)} bytes")
        try:
            check_public_key(proof.public_key)
        except IdentityError as exc:
            raise InvalidArgument(f"join proof: {exc}") from None
        if expires is None or expires < self.clock():
            raise Unauthenticated("the join challenge is unknown, used or expired; ask for a "
                                  "new one")
        expected = client_id_for(proof.public_key)
        if client_id != expected:
            raise PermissionDenied(f"client id {client_id[:40]!r} is not the id of this public "
                                   f"key ({expected}); ids derive from keys")
        if not verify(proof.public_key, proof.signature,
                      join_message(proof.nonce, client_id, proof.public_key)):
            raise Unauthenticated("the join signature does not verify with the given key")
        if self.allowed_keys is not None and proof.public_key not in self.allowed_keys:
            raise PermissionDenied(f"key of {client_id} is not on this server's allow-list")
        return bytes(proof.public_key)

    def _check_leaf(self, rec: ClientRecord) -> None:
        """Only a registered leaf aggregator may push a partial aggregate: its count and weight
        stand for many clients, so from anyone else one push could fill a buffer alone."""
        if not self.takes_partials:
            raise FailedPrecondition(
                f"this aggregator's rule {self.config.policy.defense!r} needs every update, so a "
                f"leaf's partial aggregate cannot enter it; use a decomposable rule (fedavg) "
                f"or connect the clients directly")
        if self.config.security.require_identity and rec.public_key not in self.leaf_keys:
            raise PermissionDenied(
                f"only registered leaf aggregators may push partial aggregates, and the key of "
                f"{quote(rec.client_id)} is not in this server's --leaf-keys (start the leaf "
                f"with --key FILE and add FILE.pub to the parent's --leaf-keys)")

    def _end_lost(self, now: float) -> None:
        gone = [(s, t) for s, t in self._lost.items() if now - t >= LOST_GRACE_S]
        for session, since in gone:
            self._lost.pop(session, None)
            rec = self.sessions.get(session)
            if rec is not None:
                self.drop_client(rec, f"its waiting call was cancelled from its side and it "
                                      f"has not called since ({now - since:.1f} s)")

    def leave(self, session: str) -> None:
        rec = self._checked(self._record, session)
        self._end_session(session, rec)
        log.info("client %s left", rec.client_id)
        self._changed()
