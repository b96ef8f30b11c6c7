"""The server's side of one SecAgg+ round: a state machine over plain Python values.

The gRPC servicer (server/secagg_service.py) and the simulator drive the same
:class:`SecAggRound`; neither touches its fields. Stages, in order (Bell et al. 2020, the
semi-honest protocol of Bonawitz et al. 2017 on a sparse graph)::

    KEYS    clients advertise a mask key, an encryption key and a self-seed commitment
    SHARES  each sends its neighbours Shamir shares of its self seed and mask key, sealed
    INPUT   each sends its masked input; the server adds them up (publisher thread)
    UNMASK  survivors send self-seed shares of the included, key shares of the dropped
    DONE | ABANDONED

A stage closes when every client still expected has answered, or at its deadline (the policy
calls :meth:`SecAggRound.expire`). A client that misses a stage is out of the round from then
on; the protocol survives that as long as every needed secret keeps ``t`` answering holders.
Every refusal raises a :class:`~murmura.server.errors.ServiceError` *before* anything changes,
so a bad request leaves the round as it was.

Model-sized work (adding a masked input into the sum, expanding masks to unmask) is not done
here: :meth:`SecAggRound.fold_input` and :meth:`SecAggRound.unmask_job` are run by the caller
on the publisher thread, the only thread that touches :attr:`SecAggRound._total`.

The values it takes and returns (:class:`Stage`, :class:`ClientView`, ...) live in
server/secagg_types.py and are re-exported here, where callers import them from.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from murmura.protocols.identity import verify
from murmura.protocols.secagg import (
    PRIME,
    SEED_BYTES,
    RoundAbandoned,
    Share,
    check_public_keys,
    neighbours,
    pair_seed,
    reconstruct,
    seed_commitment,
    threshold,
    unmask,
)
from murmura.protocols.secagg.envelope import COMMIT_INDEX, ENVELOPE_BYTES, keys_message
from murmura.protocols.secagg.ring import RingVector, _reduce
from murmura.protocols.secagg.weighted import (
    SecAggParams,
    decode_sum,
    decode_weighted,
    wire_words,
)
from murmura.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from murmura.server.secagg_types import (
    AdvertisedKeys,
    AlreadyExists,
    ClientView,
    NotFound,
    PeerView,
    Stage,
    UnmaskResult,
    check_identity_of,
    round_degree,
)

log = logging.getLogger(__name__)


class SecAggRound:
    """One round of SecAgg+ among ``cohort`` (client ids), for update vectors of ``size``.

    ``identities``: client id -> Ed25519 join key when the run requires identities (every key
    advert must then be signed with it), or None. ``graph_seed`` makes the neighbour graph;
    ``dropout_fraction`` sizes its degree (:func:`~murmura.protocols.secagg.default_degree`).
    """

    def __init__(self, round_id: int, cohort: list[str], *, size: int, params: SecAggParams,
                 dropout_fraction: float, graph_seed: bytes,
                 identities: Mapping[str, bytes] | None = None, sealed: bool = True) -> None:
        if sealed and len(cohort) < 2:
            raise ValueError(f"secure aggregation needs at least 2 clients, got {len(cohort)}")
        self.round_id = round_id
        self.cohort = sorted(cohort)
        #: Whether the cohort is final; an async group takes members until it is sealed, and
        #: its KEYS stage cannot close before.
        self.sealed = sealed
        #: client id -> the factor it scales its update by (staleness, async groups).
        self.factors: dict[str, float] = {}
        #: Fewer masked inputs than this and the round is abandoned (distributed DP: the
        #: noise of fewer shares would fall short of the planned noise).
        self.min_inputs = 2
        self.params = params
        self.size = size
        self.dropout_fraction = dropout_fraction
        self.graph_seed = graph_seed
        self.identities = dict(identities) if identities is not None else None
        self.stage = Stage.KEYS
        self.reason = ""
        self.gone: set[str] = set()
        self.keys: dict[str, AdvertisedKeys] = {}
        self.index: dict[str, int] = {}
        self.ids: dict[int, str] = {}
        self.graph: dict[int, frozenset[int]] = {}
        self.t = 0
        self.n_max = 0
        self.sent: dict[int, dict[int, bytes]] = {}       # sender -> receiver -> envelope
        self.mask_graph: dict[int, frozenset[int]] = {}   # the graph among the sharers
        self.inflight: set[int] = set()
        self.inputs: set[int] = set()
        self._closing_input = False
        self.included: tuple[int, ...] = ()
        self.dropped: tuple[int, ...] = ()
        self.answers: dict[tuple[int, str], dict[int, Share]] = {}
        self.answered: set[int] = set()
        self._total: RingVector | None = None  # publisher thread only
        self._peers: dict[int, tuple[PeerView, ...]] = {}     # view(): per client index
        self._held: dict[int, tuple[tuple[int, bytes], ...]] = {}
        self.result: UnmaskResult | None = None

    # -- who is expected ----------------------------------------------------------------------

    def _member(self, cid: str) -> None:
        if cid not in self.cohort:
            raise PermissionDenied(f"client {cid[:40]!r} is not in secure-aggregation round "
                                   f"{self.round_id}", reason="not in the secagg round")

    def _at(self, stage: Stage, step: str) -> None:
        if self.stage != stage:
            raise FailedPrecondition(
                f"{step} belongs to stage {stage.name}; round {self.round_id} is at stage "
                f"{self.stage.name}", reason=f"secagg {step} out of order")

    def _indexed(self, cid: str, step: str) -> int:
        i = self.index.get(cid)
        if i is None:
            raise FailedPrecondition(f"client {cid[:40]!r} dropped out of round {self.round_id} "
                                     f"before {step}", reason="secagg client dropped out")
        return i

    def expected(self) -> set[str]:
        """Clients whose answer the current stage still waits for."""
        if self.stage == Stage.KEYS:
            pending = set(self.cohort) - set(self.keys)
        elif self.stage == Stage.SHARES:
            pending = {self.ids[i] for i in self.ids if i not in self.sent}
        elif self.stage == Stage.INPUT:
            pending = {self.ids[i] for i in self.mask_graph if i not in self.inputs}
        elif self.stage == Stage.UNMASK:
            pending = {self.ids[i] for i in self.included if i not in self.answered}
        else:
            pending = set()
        return pending - self.gone

    def add_member(self, cid: str, identity: bytes | None = None) -> None:
        """An async group takes one more member (before it is sealed)."""
        if self.sealed or cid in self.cohort:
            raise ValueError(f"group {self.round_id} cannot take {cid[:40]!r}")
        self.cohort.append(cid)
        self.cohort.sort()
        if self.identities is not None:
            self.identities[cid] = identity or b""

    def seal(self) -> None:
        self.sealed = True

    def leave(self, cid: str) -> None:
        """``cid`` left or was taken for gone: no stage waits for it any more."""
        if cid in self.cohort:
            self.gone.add(cid)

    @property
    def finished(self) -> bool:
        return self.stage in (Stage.DONE, Stage.ABANDONED)

    def complete(self) -> bool:
        """Whether the current stage has every answer it waits for (and nothing in flight)."""
        if self.finished:
            return False
        if self.stage == Stage.INPUT and self.inflight:
            return False
        if self.stage == Stage.KEYS and not self.sealed:
            return False
        return not self.expected()

    def abandon(self, reason: str) -> None:
        if not self.finished:
            self.stage, self.reason = Stage.ABANDONED, reason
            self._total = None
            log.info("secure-aggregation round %d abandoned: %s", self.round_id, reason)

    # -- KEYS ---------------------------------------------------------------------------------

    def advertise(self, cid: str, keys: AdvertisedKeys) -> None:
        """Take ``cid``'s keys. Refuses a non-member, a second advert, a malformed or reused
        key, and (with identities) a signature that is not the join key's."""
        self._member(cid)
        if cid in self.keys:
            raise AlreadyExists(f"client {cid[:40]!r} already advertised its keys for round "
                                f"{self.round_id}", reason="secagg keys already advertised")
        self._at(Stage.KEYS, "AdvertiseKeys")
        for name, value, n in (("mask_public_key", keys.mask_public_key, 32),
                               ("enc_public_key", keys.enc_public_key, 32),
                               ("self_commitment", keys.self_commitment, 32)):
            if len(value) != n:
                raise InvalidArgument(f"{name} must have {n} bytes, got {len(value)}")
        if keys.mask_public_key == keys.enc_public_key:
            raise InvalidArgument("the mask and encryption keys must differ")
        used = {k for other in self.keys.values()
                for k in (other.mask_public_key, other.enc_public_key)}
        if keys.mask_public_key in used or keys.enc_public_key in used:
            raise InvalidArgument("a public key another client of this round advertised: "
                                  "replayed keys are refused", reason="secagg key replayed")
        if self.identities is not None:
            identity = self.identities.get(cid, b"")
            message = keys_message(round_id=self.round_id, client_id=cid,
                                   mask_public_key=keys.mask_public_key,
                                   enc_public_key=keys.enc_public_key,
                                   self_commitment=keys.self_commitment)
            if not identity or not verify(identity, keys.signature, message):
                raise Unauthenticated("the key advert is not signed by the client's join key",
                                      reason="secagg keys unsigned")
            keys = AdvertisedKeys(keys.mask_public_key, keys.enc_public_key,
                                  keys.self_commitment, identity, keys.signature)
        self.keys[cid] = keys

    def _close_keys(self) -> None:
        members = sorted(set(self.keys) - self.gone)
        if len(members) < 2:
            self.abandon(f"{len(members)} client(s) advertised keys; at least 2 are needed")
            return
        self.index = {cid: i + 1 for i, cid in enumerate(members)}
        self.ids = {i: cid for cid, i in self.index.items()}
        n = len(members)
        k = round_degree(n, self.dropout_fraction)
        self.t = threshold(k)
        self.graph = neighbours(n, k, self.graph_seed)
        self.n_max = n
        check_public_keys({i: self.keys[c].mask_public_key for c, i in self.index.items()})
        self.stage = Stage.SHARES

    # -- SHARES -------------------------------------------------------------------------------

    def share(self, cid: str, envelopes: Mapping[int, bytes]) -> None:
        """Take ``cid``'s sealed shares: exactly one envelope per graph neighbour."""
        self._member(cid)
        if cid in self.index and self.index[cid] in self.sent:
            raise AlreadyExists(f"client {cid[:40]!r} already shared its secrets in round "
                                f"{self.round_id}", reason="secagg shares already sent")
        self._at(Stage.SHARES, "ShareKeys")
        i = self._indexed(cid, "ShareKeys")
        unknown = sorted(set(envelopes) - self.graph[i])
        if unknown:
            raise NotFound(f"shares for client index(es) {unknown[:5]} that are not this "
                           f"client's neighbours in round {self.round_id}",
                           reason="secagg share for an unknown client")
        missing = sorted(self.graph[i] - set(envelopes))
        if missing:
            raise InvalidArgument(f"no share for neighbour index(es) {missing[:5]}: every "
                                  f"neighbour needs one", reason="secagg shares missing")
        bad = [j for j, ct in envelopes.items() if len(ct) != ENVELOPE_BYTES]
        if bad:
            raise InvalidArgument(f"envelopes have {ENVELOPE_BYTES} bytes; the one for index "
                                  f"{bad[0]} has {len(envelopes[bad[0]])}")
        self.sent[i] = dict(envelopes)

    def _close_shares(self) -> None:
        sharers = {i for i in self.sent if self.ids[i] not in self.gone}
        self.mask_graph = {i: frozenset(self.graph[i] & sharers) for i in sorted(sharers)}
        short = [i for i, peers in self.mask_graph.items() if len(peers) < self.t]
        if len(sharers) < 2 or short:
            self.abandon(f"{len(sharers)} client(s) shared secrets; "
                         f"{len(short)} kept fewer than t={self.t} sharing neighbours")
            return
        self.stage = Stage.INPUT

    # -- INPUT --------------------------------------------------------------------------------

    @property
    def input_length(self) -> int:
        return self.params.vector_length(self.size)

    def begin_input(self, cid: str, payload_bytes: int, codec: str) -> int:
        """Check a masked input's header; the caller then runs :meth:`fold_input` on the
        publisher and ends with :meth:`end_input`. Returns the client's index."""
        self._member(cid)
        i = self.index.get(cid, 0)
        if i in self.inputs or i in self.inflight:
            raise AlreadyExists(f"client {cid[:40]!r} already sent its masked input for round "
                                f"{self.round_id}", reason="secagg input already sent")
        self._at(Stage.INPUT, "MaskedInput")
        if self._closing_input:
            raise FailedPrecondition(f"round {self.round_id} stopped taking masked inputs",
                                     reason="secagg input too late")
        i = self._indexed(cid, "MaskedInput")
        if cid in self.gone:
            raise FailedPrecondition(f"client {cid[:40]!r} was taken out of round "
                                     f"{self.round_id} (gone, or its update too stale)",
                                     reason="secagg client dropped out")
        if i not in self.mask_graph:
            raise FailedPrecondition(f"client {cid[:40]!r} did not share its secrets in round "
                                     f"{self.round_id}", reason="secagg client dropped out")
        if codec != self.params.codec:
            raise InvalidArgument(f"masked inputs use codec {self.params.codec!r}, got "
                                  f"{codec[:40]!r}")
        expected = self.input_length * self.params.word_bytes
        if payload_bytes != expected:
            raise InvalidArgument(f"a masked input of this model has {self.input_length} ring "
                                  f"values ({expected} bytes); the header says {payload_bytes}",
                                  reason="secagg input of the wrong length")
        self.inflight.add(i)
        return i

    def fold_input(self, payload: bytes | bytearray | memoryview) -> None:
        """Publisher thread: parse and range-check a masked input, then add it to the sum.
        ``InvalidArgument`` (the sum unchanged) for a payload that is not a ring vector."""
        try:
            words = wire_words(payload, self.params, self.input_length)
        except ValueError as exc:
            raise InvalidArgument(str(exc), reason="secagg input out of the ring") from None
        if self._total is None:
            self._total = np.zeros(self.input_length, dtype=words.dtype)
        np.add(self._total, words, out=self._total)  # wraps modulo 2**32 or 2**64: exact

    def end_input(self, index: int, ok: bool) -> None:
        """Owner thread: the masked input of ``index`` was added (``ok``) or refused."""
        self.inflight.discard(index)
        if ok and not self.finished:
            self.inputs.add(index)

    def _close_input(self) -> None:
        if self.inflight:  # a deadline: finish the inputs being added, take no new ones
            self._closing_input = True
            return
        self.included = tuple(sorted(self.inputs))
        self.dropped = tuple(sorted(set(self.mask_graph) - self.inputs))
        if len(self.included) < max(2, self.min_inputs):
            self.abandon(f"{len(self.included)} masked input(s) arrived; at least "
                         f"{max(2, self.min_inputs)} are needed")
            return
        self.stage = Stage.UNMASK

    # -- UNMASK -------------------------------------------------------------------------------

    def requested(self, index: int) -> set[tuple[int, str]]:
        """The shares survivor ``index`` must hand back: self-seed shares of its included
        neighbours, mask-key shares of its dropped ones (never both of one client)."""
        peers = self.mask_graph.get(index, frozenset())
        inc, gone = set(self.included), set(self.dropped)
        return ({(o, "self") for o in peers & inc} | {(o, "key") for o in peers & gone})

    def respond(self, cid: str, shares: Mapping[tuple[int, str], int]) -> None:
        """Take survivor ``cid``'s shares, ``(owner index, "self"|"key") -> y``: exactly the
        set :meth:`requested` names, each value in the field."""
        self._member(cid)
        i = self.index.get(cid, 0)
        if i in self.answered:
            raise AlreadyExists(f"client {cid[:40]!r} already answered the unmasking request "
                                f"of round {self.round_id}", reason="secagg unmask already sent")
        self._at(Stage.UNMASK, "Unmask")
        if i not in self.included:
            raise FailedPrecondition(f"client {cid[:40]!r}'s masked input is not in round "
                                     f"{self.round_id}'s sum; it has nothing to unmask",
                                     reason="secagg client dropped out")
        wanted = self.requested(i)
        unknown = sorted(set(shares) - wanted)
        if unknown:
            owner, kind = unknown[0]
            raise NotFound(f"a {kind} share of client index {owner}, which this request does "
                           f"not ask this client for", reason="secagg share for an unknown client")
        missing = sorted(wanted - set(shares))
        if missing:
            raise InvalidArgument(f"{len(missing)} requested share(s) missing, e.g. the "
                                  f"{missing[0][1]} share of index {missing[0][0]}")
        if any(not 0 <= y < PRIME for y in shares.values()):
            raise InvalidArgument("a share value lies outside GF(2**521 - 1)")
        for (owner, kind), y in shares.items():
            self.answers.setdefault((owner, kind), {})[i] = Share(x=i, y=y, t=self.t,
                                                                  length=SEED_BYTES)
        self.answered.add(i)

    def _matches(self, owner: int, kind: str, secret: bytes) -> bool:
        keys = self.keys[self.ids[owner]]
        if kind == "self":
            return seed_commitment(secret, round_id=self.round_id,
                                   client=COMMIT_INDEX) == keys.self_commitment
        public = X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw()
        return public == keys.mask_public_key

    def unmask_job(self) -> Callable[[], UnmaskResult]:
        """Owner thread, once UNMASK is complete: rebuild the seeds (small: Shamir over
        ``t``-subsets, one X25519 per dropped-survivor edge), raising
        :class:`~murmura.protocols.secagg.RoundAbandoned` if some secret cannot be; return the
        model-sized rest (mask expansion, decoding) for the publisher thread."""
        if self.stage != Stage.UNMASK or self.expected():
            raise RuntimeError("the unmasking request is not complete")
        graph = self.mask_graph
        self_seeds = {
            u: reconstruct(u, "self", self.answers.get((u, "self"), {}), holders=graph[u],
                           t=self.t, matches=functools.partial(self._matches, u, "self"))
            for u in self.included}
        pair_seeds: dict[tuple[int, int], bytes] = {}
        for d in self.dropped:
            secret = reconstruct(d, "key", self.answers.get((d, "key"), {}), holders=graph[d],
                                 t=self.t, matches=functools.partial(self._matches, d, "key"))
            key = X25519PrivateKey.from_private_bytes(secret)
            for s in graph[d]:
                if s in self.included:
                    pair_seeds[(s, d)] = pair_seed(
                        key, self.keys[self.ids[s]].mask_public_key, round_id=self.round_id,
                        me=d, peer=s)
        included, dropped, bits = self.included, self.dropped, self.params.bits

        def run() -> UnmaskResult:
            assert self._total is not None
            total = _reduce(self._total.astype(np.uint64), bits)
            plain = unmask(total, graph=graph, included=included, dropped=dropped,
                           self_seeds=self_seeds, pair_seeds=pair_seeds,
                           round_id=self.round_id, bits=bits)
            summed = decode_sum(plain, count=len(included), params=self.params,
                                n_max=self.n_max)
            mean, weight = decode_weighted(plain, count=len(included), params=self.params,
                                           n_max=self.n_max)
            self._total = None
            return UnmaskResult(mean=mean, weight=weight, count=len(included),
                                total=summed[:-1])

        return run

    def finish(self, result: UnmaskResult | None, reason: str = "") -> None:
        """Owner thread: the unmasking job's outcome."""
        if result is None:
            self.abandon(reason or "unmasking failed")
        else:
            self.result, self.stage = result, Stage.DONE

    # -- progress -----------------------------------------------------------------------------

    def advance(self) -> bool:
        """Close the current stage if it is complete; True when the stage changed."""
        if not self.complete():
            return False
        return self._close()

    def expire(self) -> bool:
        """The current stage's deadline passed: close it with whoever answered."""
        if self.finished:
            return False
        if self.stage == Stage.UNMASK:
            self.gone |= self.expected()  # the silent survivors: their shares will not come
            return True
        return self._close()

    def _close(self) -> bool:
        before = self.stage
        try:
            if self.stage == Stage.KEYS:
                self._close_keys()
            elif self.stage == Stage.SHARES:
                self._close_shares()
            elif self.stage == Stage.INPUT:
                self._close_input()
            else:
                return False
        except ValueError as exc:  # e.g. two clients with one mask key
            self.abandon(str(exc))
        return self.stage != before

    def view(self, cid: str) -> ClientView:
        """What ``cid`` needs from the server for its next step."""
        self._member(cid)
        i = self.index.get(cid, 0)
        base = ClientView(self.round_id, self.stage, index=i, threshold=self.t, n_max=self.n_max,
                          reason=self.reason)
        if i == 0 or self.stage in (Stage.KEYS, Stage.ABANDONED):
            return base
        # A client asks at every stage (and a polling one more often); its neighbours are
        # fixed once the keys are in, the ciphertexts it holds once the shares are.
        peers = self._peers.get(i)
        if peers is None:
            peers = self._peers[i] = tuple(PeerView(j, self.ids[j], self.keys[self.ids[j]])
                                           for j in sorted(self.graph[i]))
        cts: tuple[tuple[int, bytes], ...] = ()
        if self.stage >= Stage.INPUT and i in self.mask_graph:
            cts = self._held.get(i, ())
            if not cts:
                cts = self._held[i] = tuple((j, self.sent[j][i])
                                            for j in sorted(self.mask_graph[i]))
        inc = self.included if self.stage >= Stage.UNMASK else ()
        drop = self.dropped if self.stage >= Stage.UNMASK else ()
        return ClientView(self.round_id, self.stage, index=i, threshold=self.t,
                          n_max=self.n_max, neighbours=peers, ciphertexts=cts, included=inc,
                          dropped=drop, reason=self.reason,
                          factor=self.factors.get(cid, 1.0) if self.stage >= Stage.INPUT
                          else 1.0, min_inputs=self.min_inputs)


__all__ = ["AdvertisedKeys", "AlreadyExists", "ClientView", "NotFound", "PeerView",
           "RoundAbandoned", "SecAggRound", "Stage", "UnmaskResult", "check_identity_of",
           "round_degree"]
