"""The client's side of a SecAgg+ round: a state machine, and a driver over the wire.

:class:`SecAggClient` holds one round's secrets and turns what the server broadcasts into
the client's next message; it does no I/O, so the gRPC driver (:func:`run_round`) and the
simulator run the very same steps. What it checks, because the server is not trusted with it:

* every neighbour's key advert is signed by the neighbour's join key, whose derived id is the
  neighbour's id (when the run requires identities), and no two neighbours share a key;
* shares arrive sealed (``protocols/secagg/envelope.py``) from the neighbours the graph names;
* the unmasking request (the consistency check): the included and dropped sets are disjoint,
  hold only neighbours that sent it shares, and include this client; a request asking for
  both the self-seed and the key share of one client is refused, which is what keeps a
  merely slow client from being unmasked alone.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, cast

import grpc
import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from murmura.client.transport import GrpcTransport
from murmura.protocols import UpdateHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.identity import NodeKey, client_id_for, payload_digest, verify
from murmura.protocols.secagg import SEED_BYTES, mask, pair_seed, seed_commitment, split
from murmura.protocols.secagg.envelope import (
    COMMIT_INDEX,
    SharePair,
    keys_message,
    open_envelope,
    seal,
)
from murmura.protocols.secagg.weighted import SecAggParams, encode_weighted, to_wire

log = logging.getLogger(__name__)
T = TypeVar("T")

STAGES = ("KEYS", "SHARES", "INPUT", "UNMASK", "DONE", "ABANDONED")


class SecAggRefused(Exception):
    """The server's broadcast fails a check: this client stops taking part in the round."""


@dataclass(frozen=True)
class Peer:
    """A neighbour's advert as relayed by the server."""

    index: int
    client_id: str
    mask_public_key: bytes
    enc_public_key: bytes
    self_commitment: bytes
    identity_key: bytes = b""
    signature: bytes = b""


@dataclass
class SecAggClient:
    """One client's secrets and steps for one round (fresh keys every round).

    ``require_identity``: neighbours' adverts must be signed by their join keys, and this
    client signs its own with ``identity``.
    """

    client_id: str
    round_id: int
    params: SecAggParams
    identity: NodeKey | None = None
    require_identity: bool = False
    rng: np.random.Generator | None = None
    mask_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    enc_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    self_seed: bytes = field(default_factory=lambda: os.urandom(SEED_BYTES))
    index: int = 0
    t: int = 0
    n_max: int = 0
    peers: dict[int, Peer] = field(default_factory=dict)
    held: dict[int, SharePair] = field(default_factory=dict)

    # -- KEYS ---------------------------------------------------------------------------------

    def keys(self) -> tuple[bytes, bytes, bytes, bytes]:
        """(mask public key, encryption public key, self-seed commitment, signature)."""
        mask_pk = self.mask_key.public_key().public_bytes_raw()
        enc_pk = self.enc_key.public_key().public_bytes_raw()
        commitment = seed_commitment(self.self_seed, round_id=self.round_id,
                                     client=COMMIT_INDEX)
        signature = b""
        if self.identity is not None:
            signature = self.identity.sign(keys_message(
                round_id=self.round_id, client_id=self.client_id, mask_public_key=mask_pk,
                enc_public_key=enc_pk, self_commitment=commitment))
        return mask_pk, enc_pk, commitment, signature

    # -- SHARES -------------------------------------------------------------------------------

    def share(self, index: int, t: int, n_max: int, peers: list[Peer]) -> dict[int, bytes]:
        """Check the neighbours' adverts, then seal one envelope per neighbour."""
        if index < 1 or not peers or not 1 <= t <= len(peers):
            raise SecAggRefused(f"the server sent index {index}, t={t} and {len(peers)} "
                                f"neighbours")
        seen: set[bytes] = {self.mask_key.public_key().public_bytes_raw(),
                            self.enc_key.public_key().public_bytes_raw()}
        for p in peers:
            if p.index == index or p.index < 1 or p.index in self.peers:
                raise SecAggRefused(f"neighbour index {p.index} is invalid or repeated")
            if {p.mask_public_key, p.enc_public_key} & seen or len(p.mask_public_key) != 32:
                raise SecAggRefused(f"neighbour {p.index} advertised a reused or malformed key")
            seen |= {p.mask_public_key, p.enc_public_key}
            if self.require_identity:
                message = keys_message(round_id=self.round_id, client_id=p.client_id,
                                       mask_public_key=p.mask_public_key,
                                       enc_public_key=p.enc_public_key,
                                       self_commitment=p.self_commitment)
                try:
                    owner_ok = client_id_for(p.identity_key) == p.client_id
                except ValueError:
                    owner_ok = False
                if not (owner_ok and verify(p.identity_key, p.signature, message)):
                    raise SecAggRefused(f"neighbour {p.client_id[:40]!r}'s keys are not signed "
                                        f"by its join key: the server may have swapped them")
            self.peers[p.index] = p
        self.index, self.t, self.n_max = index, t, n_max
        holders = sorted(self.peers)
        self_shares = split(self.self_seed, len(holders), t, xs=holders)
        key_shares = split(self.mask_key.private_bytes_raw(), len(holders), t, xs=holders)
        out = {}
        for s, k in zip(self_shares, key_shares, strict=True):
            pair = SharePair(sender=index, receiver=s.x, t=t, self_y=s.y, key_y=k.y)
            out[s.x] = seal(self.enc_key, self.peers[s.x].enc_public_key, pair,
                            round_id=self.round_id)
        return out

    # -- INPUT --------------------------------------------------------------------------------

    def masked_input(self, ciphertexts: Mapping[int, bytes], update: np.ndarray,
                     examples: float, factor: float = 1.0, min_inputs: int = 0) -> np.ndarray:
        """Open the neighbours' envelopes, then mask the weighted, quantised update with the
        pairwise seeds of exactly the neighbours whose shares arrived (the server's sharers)."""
        unknown = set(ciphertexts) - set(self.peers)
        if unknown:
            raise SecAggRefused(f"envelopes from non-neighbours {sorted(unknown)[:5]}")
        for j, ct in ciphertexts.items():
            try:
                self.held[j] = open_envelope(self.enc_key, self.peers[j].enc_public_key, ct,
                                             round_id=self.round_id, sender=j,
                                             receiver=self.index)
            except ValueError as exc:
                raise SecAggRefused(str(exc)) from None
            if self.held[j].t != self.t:
                raise SecAggRefused(f"neighbour {j}'s shares use threshold {self.held[j].t}")
        if len(self.held) < self.t:
            raise SecAggRefused(f"{len(self.held)} neighbours shared with this client; the "
                                f"threshold is {self.t}")
        noise_rng = None
        if self.params.distributed_dp:
            if not 1 <= min_inputs <= self.n_max:
                raise SecAggRefused(f"the server plans {min_inputs} inputs for the noise; a "
                                    f"round of {self.n_max} needs 1..{self.n_max}")
            # the noise must be unpredictable to the server: seeded from the OS, never from
            # anything the run shares (a simulation's seeded rng is for reproducibility only)
            noise_rng = self.rng or np.random.default_rng(secrets.randbits(128))
        try:
            x = encode_weighted(update, examples, self.params, n_max=self.n_max, rng=self.rng,
                                factor=factor, min_inputs=min_inputs, noise_rng=noise_rng)
        except ValueError as exc:  # e.g. a factor outside [0, 1]
            raise SecAggRefused(str(exc)) from None
        seeds = {j: pair_seed(self.mask_key, self.peers[j].mask_public_key,
                              round_id=self.round_id, me=self.index, peer=j)
                 for j in self.held}
        return mask(self.index, x, self_seed=self.self_seed, pair_seeds=seeds,
                    round_id=self.round_id, bits=self.params.bits)

    # -- UNMASK -------------------------------------------------------------------------------

    def unmask(self, included: list[int], dropped: list[int]) -> dict[tuple[int, str], int]:
        """The consistency check, then the shares the server asked for."""
        inc, gone = set(included), set(dropped)
        if inc & gone:
            raise SecAggRefused("the server names a client as both included and dropped")
        if self.index not in inc:
            raise SecAggRefused("the server asks for shares but leaves this client's input out")
        strangers = (inc | gone) & set(self.peers) - set(self.held)
        if strangers:
            raise SecAggRefused(f"clients {sorted(strangers)[:5]} never shared with this one")
        out: dict[tuple[int, str], int] = {}
        for j, pair in self.held.items():
            if j in inc:
                out[(j, "self")] = pair.self_y
            elif j in gone:
                out[(j, "key")] = pair.key_y
            else:
                raise SecAggRefused(f"neighbour {j} is neither included nor dropped")
        return out


# ---------------------------------------------------------------------------------------------
# The driver over gRPC
# ---------------------------------------------------------------------------------------------


class SecAggLink:
    """The SecureAggregation RPCs on an open channel, with deadlines and status codes kept."""

    def __init__(self, channel: grpc.Channel, *, timeout_s: float = 60.0,
                 chunk_bytes: int = serde.CHUNK_BYTES) -> None:
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        svc = "/murmura.v1.SecureAggregation/"
        self._advertise = channel.unary_unary(svc + "AdvertiseKeys",
                                              request_serializer=pb.SecAggKeys.SerializeToString,
                                              response_deserializer=pb.SecAggAck.FromString)
        self._share = channel.unary_unary(svc + "ShareKeys",
                                          request_serializer=pb.SecAggShares.SerializeToString,
                                          response_deserializer=pb.SecAggAck.FromString)
        self._input = channel.stream_unary(svc + "MaskedInput",
                                           request_serializer=serde.serialize_update_item,
                                           response_deserializer=pb.SecAggAck.FromString)
        self._unmask = channel.unary_unary(svc + "Unmask",
                                           request_serializer=pb.SecAggUnmask.SerializeToString,
                                           response_deserializer=pb.SecAggAck.FromString)
        self._poll = channel.unary_unary(svc + "Poll",
                                         request_serializer=pb.SecAggPollRequest.SerializeToString,
                                         response_deserializer=pb.SecAggState.FromString)
        self.bytes_up = 0

    def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            raise GrpcTransport._wrap(exc) from None

    def advertise(self, req: pb.SecAggKeys) -> None:
        self.bytes_up += req.ByteSize()
        self._call(self._advertise, req, timeout=self.timeout_s)

    def share(self, req: pb.SecAggShares) -> None:
        self.bytes_up += req.ByteSize()
        self._call(self._share, req, timeout=self.timeout_s)

    def masked_input(self, header: UpdateHeader, payload: bytes) -> None:
        items = list(serde.iter_update_items(header, payload, self.chunk_bytes))
        self.bytes_up += sum(serde.data_chunk_wire_bytes(len(c)) if isinstance(c, memoryview)
                             else c.ByteSize() for c in items)
        self._call(self._input, iter(items), timeout=self.timeout_s)

    def unmask(self, req: pb.SecAggUnmask) -> None:
        self.bytes_up += req.ByteSize()
        self._call(self._unmask, req, timeout=self.timeout_s)

    def poll(self, session: str, round_id: int, after: int, wait_s: float) -> pb.SecAggState:
        req = pb.SecAggPollRequest(session=session, round=round_id,
                                   after=cast("pb.SecAggState.Stage", after), wait_s=wait_s)
        return self._call(self._poll, req, timeout=wait_s + self.timeout_s)


def peers_from_proto(state: pb.SecAggState) -> list[Peer]:
    return [Peer(index=p.index, client_id=p.client_id, mask_public_key=p.mask_public_key,
                 enc_public_key=p.enc_public_key, self_commitment=p.self_commitment,
                 identity_key=p.identity_key, signature=p.signature) for p in state.neighbours]


#: Tests: a hook called with the stage name just before the client takes that step; raising
#: from it plays a client that dies there.
StepHook = Callable[[str], None]


def run_round(link: SecAggLink, *, session: str, round_id: int, client: SecAggClient,
              update: np.ndarray, examples: float, base_version: int, spec_fingerprint: str,
              identity: NodeKey | None, wait_s: float = 10.0,
              hook: StepHook | None = None, clock: Callable[[], float] = time.monotonic,
              give_up_s: float = 600.0) -> str:
    """Play one round: keys, shares, masked input, unmasking. Returns the final stage name
    (``DONE``/``ABANDONED``), or the stage the client left at when the server moved on without
    it. refusals propagate as ``RemoteError``; a failed check raises SecAggRefused."""
    step = hook or (lambda name: None)
    end = clock() + give_up_s

    def wait(after: int) -> pb.SecAggState:
        while True:
            state = link.poll(session, round_id, after, wait_s)
            if state.stage != after or clock() > end:
                return state

    step("KEYS")
    mask_pk, enc_pk, commitment, signature = client.keys()
    link.advertise(pb.SecAggKeys(session=session, round=round_id, mask_public_key=mask_pk,
                                 enc_public_key=enc_pk, self_commitment=commitment,
                                 signature=signature))
    state = wait(pb.SecAggState.KEYS)
    if state.stage != pb.SecAggState.SHARES:
        return STAGES[state.stage]
    step("SHARES")
    envelopes = client.share(state.index, state.threshold, state.n_max, peers_from_proto(state))
    link.share(pb.SecAggShares(session=session, round=round_id, shares=[
        pb.SecAggCiphertext(peer=j, ciphertext=ct) for j, ct in sorted(envelopes.items())]))
    state = wait(pb.SecAggState.SHARES)
    if state.stage != pb.SecAggState.INPUT:
        return STAGES[state.stage]
    step("INPUT")
    masked = client.masked_input({c.peer: c.ciphertext for c in state.ciphertexts}, update,
                                 examples, factor=state.factor, min_inputs=state.min_inputs)
    payload = to_wire(masked, client.params)
    header = UpdateHeader(session=session, update_id=f"secagg-{round_id}", round=round_id,
                          base_version=base_version, num_examples=0, codec=client.params.codec,
                          payload_bytes=len(payload), spec_fingerprint=spec_fingerprint)
    if identity is not None:
        header = identity.sign_update(header, payload_digest(payload))
    link.masked_input(header, payload)
    state = wait(pb.SecAggState.INPUT)
    if state.stage != pb.SecAggState.UNMASK:
        return STAGES[state.stage]
    step("UNMASK")
    shares = client.unmask(list(state.included), list(state.dropped))
    link.unmask(pb.SecAggUnmask(session=session, round=round_id, shares=[
        pb.SecAggShare(owner=o, key=(kind == "key"), y=y.to_bytes(66, "big"))
        for (o, kind), y in sorted(shares.items())]))
    state = wait(pb.SecAggState.UNMASK)
    return STAGES[state.stage]


__all__ = ["Peer", "SecAggClient", "SecAggLink", "SecAggRefused", "StepHook",
           "peers_from_proto", "run_round"]
