"""The pure cryptographic core of secure aggregation (SecAgg+): the server learns only the sum.

Threat model. The server is honest but curious: it runs the protocol as written and tries to learn
individual updates from what it sees (public keys, encrypted shares, masked inputs, the shares
survivors hand back). Each masked input is its quantised update plus a self-mask and pairwise
masks, all ChaCha20 streams that cancel or are removed only in the sum, so an individual masked
vector is computationally indistinguishable from uniform. The server never holds both the self-mask
seed and the key of the same client: a responding client refuses a request that names one client as
both included and dropped (:meth:`SimClient.respond`), which is what keeps a client that is merely
slow from being unmasked alone. Security against up to ``t - 1`` colluding neighbours of a client
follows from the Shamir threshold. A *malicious* server can still do what the semi-honest protocol
cannot stop: choose the neighbour graph (here it comes from a seed; a production deployment should
derive it from a seed the clients contribute to), lie to different clients about who dropped (the
consistency round and signatures of the active-adversary version of Bonawitz et al. are not
implemented), or give clients forged public keys (the gRPC wiring signs every key advert
with the joining identity of ``protocols/identity.py`` when the run requires identities, and
clients check it: client/secagg.py). Clients are not checked either: a client may send
any ring element (SecAgg hides inputs, it does not bound them; range proofs would), and only a sum
outside the possible range is caught, by :func:`dequantise`.

What the server still learns: who is in the cohort, who dropped at which step, the timing of every
message, the vector length, and the sum itself (which differential privacy, not SecAgg, has to
protect). A round where too few neighbours of some needed client answer is abandoned with
:class:`RoundAbandoned`; nothing partially unmasked is returned.

Parameters and costs, for ``n`` clients, neighbour degree ``k`` (:func:`default_degree`,
``O(log n)``), threshold ``t`` (:func:`threshold`) and model length ``m``. Client: ``k`` X25519
agreements, ``2k`` Shamir shares of two 32-byte secrets, ``k + 1`` ChaCha20 expansions of ``m``
ring words. Server: unmasking costs ``O(n)`` self-mask expansions, one per included client, plus
one per edge between a dropped and an included client (``O(n k)`` in total), and ``O(n k^2)``
field operations of Lagrange interpolation. The ring is ``Z_{2**bits}``, held in ``uint64`` whose
wrap-around is exactly reduction modulo ``2**64`` (``bits < 64`` adds one bit mask): a power-of-two
ring needs no modular reduction in the hot path and is what SecAgg implementations use for masks.

References: K. Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", ACM CCS 2017, https://eprint.iacr.org/2017/281 ; J. Bell et al., "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead", ACM CCS 2020, https://eprint.iacr.org/2020/704 .
"""

from __future__ import annotations

from murmura.protocols.secagg.graph import default_degree, neighbours, threshold
from murmura.protocols.secagg.keys import SEED_BYTES, expand_mask, pair_seed, seed_commitment
from murmura.protocols.secagg.ring import FieldSpec, RingVector, dequantise, quantise
from murmura.protocols.secagg.rounds import (
    Round,
    RoundAbandoned,
    SimClient,
    Tamper,
    check_public_keys,
    mask,
    reconstruct,
    unmask,
)
from murmura.protocols.secagg.shamir import PRIME, Share, combine, split

__all__ = [
    "PRIME",
    "SEED_BYTES",
    "FieldSpec",
    "RingVector",
    "Round",
    "RoundAbandoned",
    "Share",
    "SimClient",
    "Tamper",
    "check_public_keys",
    "combine",
    "default_degree",
    "dequantise",
    "expand_mask",
    "mask",
    "neighbours",
    "pair_seed",
    "quantise",
    "reconstruct",
    "seed_commitment",
    "split",
    "threshold",
    "unmask",
]

#: Ring elements: values in ``[0, 2**bits)`` held in ``uint64``.
