"""Masking, unmasking, and an in-memory round of the whole protocol."""

from __future__ import annotations

import itertools
import os
import random
import secrets
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from murmura.protocols.secagg.graph import default_degree, neighbours, threshold
from murmura.protocols.secagg.keys import (
    SEED_BYTES,
    MaskStreams,
    pair_seed,
    seed_commitment,
)
from murmura.protocols.secagg.ring import (
    RingVector,
    _check_ring,
    _reduce,
)
from murmura.protocols.secagg.shamir import PRIME, Share, combine, split

#: How many ``t``-subsets of the shares are tried before a reconstruction is given up.
_MAX_COMBINATIONS = 256


class RoundAbandoned(Exception):
    """Too few clients answered to unmask the sum: the round has no result, and none is partial."""


# --------------------------------------------------------------------------------------------
# Masking and unmasking
# --------------------------------------------------------------------------------------------


def mask(
    client: int,
    x_ints: RingVector,
    *,
    self_seed: bytes,
    pair_seeds: Mapping[int, bytes],
    round_id: int,
    bits: int,
) -> RingVector:
    """``y = x + PRG(b) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)`` in ``Z_{2**bits}``."""
    x = _check_ring(x_ints, bits, "x_ints")
    if client in pair_seeds:
        raise ValueError("a client has no pairwise mask with itself")
    y = _words(x, bits)
    streams = MaskStreams(x.shape[0], bits=bits)
    np.add(y, streams.words(self_seed, round_id=round_id, purpose="self"), out=y)
    for j, seed in pair_seeds.items():
        stream = streams.words(seed, round_id=round_id, purpose="pair")
        (np.add if j > client else np.subtract)(y, stream, out=y)
    return _reduce(y.astype(np.uint64), bits)


def _words(x: RingVector, bits: int) -> np.ndarray:
    """A writable copy of ring elements in the mask streams' word dtype (see
    :func:`~murmura.protocols.secagg.keys.expand_words`: arithmetic there wraps modulo a
    multiple of ``2**bits``)."""
    return x.astype(np.uint32 if bits <= 32 else np.uint64)


def unmask(
    sum_y: RingVector,
    *,
    graph: Mapping[int, Collection[int]],
    included: Collection[int],
    dropped: Collection[int],
    self_seeds: Mapping[int, bytes],
    pair_seeds: Mapping[tuple[int, int], bytes],
    round_id: int,
    bits: int,
) -> RingVector:
    """Remove every mask from the sum of the ``included`` clients' masked inputs.

    ``self_seeds`` must hold exactly the included clients; ``pair_seeds`` exactly the pairs
    ``(survivor, dropped)`` with ``survivor`` included and a graph neighbour of ``dropped`` (the
    masks those survivors added with clients whose input never arrived). Anything missing or extra
    raises ``ValueError``: no partially unmasked sum ever comes out.
    """
    total = _check_ring(sum_y, bits, "sum_y")
    inc, gone = set(included), set(dropped)
    if inc & gone:
        raise ValueError("a client cannot be both included and dropped")
    if set(self_seeds) != inc:
        raise ValueError("self_seeds must cover exactly the included clients")
    needed = {(s, d) for d in gone for s in graph[d] if s in inc}
    if set(pair_seeds) != needed:
        raise ValueError("pair_seeds must cover exactly the (included, dropped) neighbour pairs")
    out = _words(total, bits)
    streams = MaskStreams(out.shape[0], bits=bits)
    for seed in self_seeds.values():
        np.subtract(out, streams.words(seed, round_id=round_id, purpose="self"), out=out)
    for (s, d), seed in pair_seeds.items():
        stream = streams.words(seed, round_id=round_id, purpose="pair")
        (np.subtract if s < d else np.add)(out, stream, out=out)  # undo what survivor s added
    return _reduce(out.astype(np.uint64), bits)


# --------------------------------------------------------------------------------------------
# An in-memory round, end to end
# --------------------------------------------------------------------------------------------


def check_public_keys(keys: Mapping[int, bytes]) -> None:
    """Refuse malformed or repeated public keys: a replayed key would let its owner's peers'
    pairwise masks be derived by whoever holds the original private key."""
    if any(len(k) != 32 for k in keys.values()):
        raise ValueError("every X25519 public key must have 32 bytes")
    if len(set(keys.values())) != len(keys):
        raise ValueError("two clients presented the same public key")


def reconstruct(owner: int, kind: str, answers: Mapping[int, Share], *,
                holders: Collection[int], t: int, matches: Callable[[bytes], bool]) -> bytes:
    """Rebuild ``owner``'s secret from the holders' answers, or raise :class:`RoundAbandoned`.

    Structurally malformed shares (coordinate other than the holder's id, holder not among
    ``holders``, wrong threshold or length, value outside the field) are dropped; then up to
    ``_MAX_COMBINATIONS`` subsets of ``t`` shares are tried until one reconstructs a secret that
    ``matches`` accepts (the owner's self-seed commitment or its public key), which also gets
    past well-formed shares with a wrong value. The in-memory :class:`Round` and the server's
    round share this function, so both accept and refuse exactly the same answers.
    """
    valid = [
        s
        for holder, s in sorted(answers.items())
        if s.x == holder
        and holder in holders
        and s.t == t
        and s.length == SEED_BYTES
        and 0 <= s.y < PRIME
    ]
    if len(valid) < t:
        raise RoundAbandoned(f"{len(valid)} valid {kind} shares of client {owner}, threshold {t}")
    for subset in itertools.islice(itertools.combinations(valid, t), _MAX_COMBINATIONS):
        try:
            secret = combine(subset)
        except ValueError:
            continue
        if matches(secret):
            return secret
    raise RoundAbandoned(f"no consistent {kind} shares of client {owner}")


#: ``tamper(holder, owner, kind, share) -> share``: a test hook that alters a returned share.
Tamper = Callable[[int, int, str, Share], Share]


@dataclass
class SimClient:
    """One simulated client: its keys, its self-mask seed, and the shares it holds for others."""

    cid: int
    private_key: X25519PrivateKey
    self_seed: bytes
    held: dict[tuple[int, str], Share] = field(default_factory=dict)

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte X25519 public key it advertises."""
        return self.private_key.public_key().public_bytes_raw()

    def respond(
        self, included: Collection[int], dropped: Collection[int]
    ) -> dict[tuple[int, str], Share]:
        """Shares for the server: self-mask shares of included clients, key shares of dropped ones.

        Refuses a request naming a client in both sets (that would unmask the client alone).
        """
        if set(included) & set(dropped):
            raise ValueError("refusing to reveal both the self-mask and the key of one client")
        out = {}
        for (owner, kind), share in self.held.items():
            if (kind == "self" and owner in included) or (kind == "key" and owner in dropped):
                out[(owner, kind)] = share
        return out


class Round:
    """A whole SecAgg+ round in memory, for tests and the simulator; no I/O, no clock.

    Clients ``1..n``; ``seed`` makes keys, seeds, shares and the graph reproducible (a real client
    draws them from the OS CSPRNG, as ``seed=None`` does here). :meth:`run` plays the steps
    advertise keys -> share secrets with neighbours -> masked input -> unmasking requests ->
    reconstruction -> unmask, with dropouts before the masked input (their pairwise masks are
    removed through their reconstructed keys) and after it (their self-masks are removed through
    their reconstructed seeds).
    """

    def __init__(
        self,
        n: int,
        *,
        round_id: int,
        bits: int = 32,
        degree: int | None = None,
        t: int | None = None,
        dropout_fraction: float = 0.3,
        seed: int | None = None,
    ) -> None:
        if n < 2:
            raise ValueError(f"a round needs at least 2 clients, got {n}")
        self.n, self.round_id, self.bits = n, round_id, bits
        k = default_degree(n, dropout_fraction) if degree is None else min(degree, n - 1)
        self.t = threshold(k) if t is None else t
        if not k / 2 < self.t <= k:
            raise ValueError(f"the threshold must satisfy k/2 < t <= k, got t={self.t}, k={k}")
        self.k = k
        if seed is None:
            self._rng: random.Random = secrets.SystemRandom()
            graph_seed = os.urandom(SEED_BYTES)
        else:
            self._rng = random.Random(seed)
            graph_seed = self._rng.randbytes(SEED_BYTES)
        self.graph = neighbours(n, k, graph_seed)
        self.clients = {
            i: SimClient(
                cid=i,
                private_key=X25519PrivateKey.from_private_bytes(self._rng.randbytes(SEED_BYTES)),
                self_seed=self._rng.randbytes(SEED_BYTES),
            )
            for i in range(1, n + 1)
        }
        #: What the server relays; tests may alter it to play a replayed key.
        self.public_keys = {i: c.public_key for i, c in self.clients.items()}
        self.commitments = {
            i: seed_commitment(c.self_seed, round_id=round_id, client=i)
            for i, c in self.clients.items()
        }

    def _share_secrets(self) -> None:
        for i, client in self.clients.items():
            holders = sorted(self.graph[i])
            secrets_ = {
                "self": client.self_seed,
                "key": client.private_key.private_bytes_raw(),
            }
            for kind, secret in secrets_.items():
                for share in split(secret, len(holders), self.t, self._rng, xs=holders):
                    self.clients[share.x].held[(i, kind)] = share

    def masked_input(self, client: int, x_ints: RingVector) -> RingVector:
        """Client ``client``'s masked input, with pairwise seeds from the advertised keys."""
        me = self.clients[client]
        seeds = {
            j: pair_seed(
                me.private_key, self.public_keys[j], round_id=self.round_id, me=client, peer=j
            )
            for j in self.graph[client]
        }
        return mask(
            client,
            x_ints,
            self_seed=me.self_seed,
            pair_seeds=seeds,
            round_id=self.round_id,
            bits=self.bits,
        )

    def _matches(self, owner: int, kind: str, secret: bytes) -> bool:
        """Whether a reconstructed secret is the one ``owner`` committed to when advertising."""
        if kind == "self":
            commitment = seed_commitment(secret, round_id=self.round_id, client=owner)
            return commitment == self.commitments[owner]
        public = X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw()
        return public == self.public_keys[owner]

    def _reconstruct(self, owner: int, kind: str, answers: Mapping[int, Share]) -> bytes:
        return reconstruct(owner, kind, answers, holders=self.graph[owner], t=self.t,
                           matches=lambda secret: self._matches(owner, kind, secret))

    def run(
        self,
        inputs: Mapping[int, RingVector],
        *,
        drop_before_input: Collection[int] = (),
        drop_before_unmask: Collection[int] = (),
        tamper: Tamper | None = None,
    ) -> RingVector:
        """Play the round on ``inputs`` (one ring vector per client) and return the unmasked sum
        of the clients whose masked input arrived; raise :class:`RoundAbandoned` if some needed
        neighbourhood has fewer than ``t`` responders, ``ValueError`` on a repeated public key."""
        check_public_keys(self.public_keys)
        if set(inputs) != set(self.clients):
            raise ValueError("inputs must hold one vector per client 1..n")
        if not set(drop_before_input) | set(drop_before_unmask) <= set(self.clients):
            raise ValueError("dropouts must be clients of the round")
        self._share_secrets()
        included = sorted(set(self.clients) - set(drop_before_input))
        dropped = sorted(set(drop_before_input))
        if not included:
            raise RoundAbandoned("no masked input arrived")
        total: RingVector | None = None
        for i in included:
            y = self.masked_input(i, inputs[i])
            total = y if total is None else _reduce(total + y, self.bits)
        assert total is not None
        responders = set(included) - set(drop_before_unmask)
        answers: dict[tuple[int, str], dict[int, Share]] = {}
        for j in sorted(responders):
            for (owner, kind), share in self.clients[j].respond(included, dropped).items():
                if tamper is not None:
                    share = tamper(j, owner, kind, share)
                answers.setdefault((owner, kind), {})[j] = share
        self_seeds = {
            u: self._reconstruct(u, "self", answers.get((u, "self"), {})) for u in included
        }
        pair_seeds: dict[tuple[int, int], bytes] = {}
        for d in dropped:
            key_bytes = self._reconstruct(d, "key", answers.get((d, "key"), {}))
            key = X25519PrivateKey.from_private_bytes(key_bytes)
            for s in self.graph[d]:
                if s in self.clients and s not in dropped:
                    pair_seeds[(s, d)] = pair_seed(
                        key, self.public_keys[s], round_id=self.round_id, me=d, peer=s
                    )
        return unmask(
            total,
            graph=self.graph,
            included=included,
            dropped=dropped,
            self_seeds=self_seeds,
            pair_seeds=pair_seeds,
            round_id=self.round_id,
            bits=self.bits,
        )
