"""Pairwise seeds (X25519, HKDF) and ChaCha20 mask expansion."""

from __future__ import annotations

import hashlib

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from murmura.protocols.secagg.ring import RingVector, _reduce

#: Length of every mask seed and of an X25519 private key.
SEED_BYTES = 32
_MAX_ID = (1 << 32) - 1
_PURPOSES = {"self": b"self", "pair": b"pair"}

# --------------------------------------------------------------------------------------------
# Key agreement and PRG
# --------------------------------------------------------------------------------------------


def _check_id(client: int) -> int:
    if not 1 <= client <= _MAX_ID:
        raise ValueError(f"client ids must be in [1, 2**32 - 1], got {client}")
    return client


def pair_seed(
    private_key: X25519PrivateKey, peer_public: bytes, *, round_id: int, me: int, peer: int
) -> bytes:
    """The 32-byte pairwise mask seed of ``me`` and ``peer``: X25519, then HKDF-SHA256.

    The HKDF ``info`` binds the seed to the round and to both ids in sorted order, so both ends
    derive the same seed and no seed is reused across rounds or pairs.
    """
    if _check_id(me) == _check_id(peer):
        raise ValueError("a client has no pairwise seed with itself")
    if len(peer_public) != 32:
        raise ValueError(f"an X25519 public key has 32 bytes, got {len(peer_public)}")
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    lo, hi = sorted((me, peer))
    info = b"murmura/secagg/pair/v1" + _u64(round_id) + lo.to_bytes(4, "little")
    info += hi.to_bytes(4, "little")
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=info).derive(shared)


def _u64(value: int) -> bytes:
    if not 0 <= value < 1 << 64:
        raise ValueError(f"round ids must be in [0, 2**64), got {value}")
    return value.to_bytes(8, "little")


def expand_words(
    seed: bytes, length: int, *, bits: int, round_id: int, purpose: str = "pair"
) -> np.ndarray:
    """The raw ChaCha20 words behind :func:`expand_mask`: ``uint32`` for rings of up to 32
    bits, ``uint64`` above, not yet reduced to the ring. Sums of them in that dtype wrap
    modulo ``2**32`` or ``2**64``, which ``2**bits`` divides, so masks can be added and removed
    in the word dtype (half the memory traffic of ``uint64`` for 32-bit rings) and reduced
    once at the end (:class:`MaskStreams` expands many into one scratch buffer)."""
    return MaskStreams(length, bits=bits).words(seed, round_id=round_id, purpose=purpose)


class MaskStreams:
    """Expands many mask streams of one length into the same two scratch buffers.

    A zero input and an output per stream cost more in fresh pages than the cipher does (about
    3x for 100,000 words), and a server that unmasks a round with dropouts expands hundreds of
    them. :meth:`words` returns a view that the next call overwrites: add it in, then expand
    the next one.
    """

    def __init__(self, length: int, *, bits: int) -> None:
        if length < 0:
            raise ValueError(f"length must be non-negative, got {length}")
        if not 2 <= bits <= 64:
            raise ValueError(f"bits must be in [2, 64], got {bits}")
        self.length, self.bits = length, bits
        self._dtype = np.dtype("<u4" if bits <= 32 else "<u8")
        self._zeros = bytes(self._dtype.itemsize * length)
        self._out = bytearray(self._dtype.itemsize * length + 64)  # update_into's slack

    def words(self, seed: bytes, *, round_id: int, purpose: str = "pair") -> np.ndarray:
        """The ``length`` keystream words of ``seed`` for this round and purpose (the
        16-byte nonce: a zero block counter, the purpose tag, the round id), valid until the
        next call."""
        if len(seed) != SEED_BYTES:
            raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
        if purpose not in _PURPOSES:
            raise ValueError(f"purpose must be one of {sorted(_PURPOSES)}, got {purpose!r}")
        nonce = bytes(4) + _PURPOSES[purpose] + _u64(round_id)
        encryptor = Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor()
        n = encryptor.update_into(self._zeros, self._out)
        return np.frombuffer(self._out, dtype=self._dtype, count=n // self._dtype.itemsize)


def expand_mask(
    seed: bytes, length: int, *, bits: int, round_id: int, purpose: str = "pair"
) -> RingVector:
    """Expand ``seed`` into ``length`` uniform elements of ``Z_{2**bits}`` with ChaCha20.

    The 16-byte ChaCha20 nonce is a zero block counter, a 4-byte purpose tag (``self``/``pair``)
    and the round id, so the self-mask and pairwise streams are separated even for equal keys.
    Words are 4 bytes (``bits <= 32``) or 8 bytes, little-endian, reduced to the ring by taking
    their low bits, which keeps them uniform.
    """
    words = expand_words(seed, length, bits=bits, round_id=round_id, purpose=purpose)
    return _reduce(words.astype(np.uint64), bits)


def seed_commitment(seed: bytes, *, round_id: int, client: int) -> bytes:
    """A SHA-256 commitment to a self-mask seed, published so a reconstruction can be checked."""
    data = b"murmura/secagg/self-commit/v1" + _u64(round_id)
    data += _check_id(client).to_bytes(4, "little")
    return hashlib.sha256(data + seed).digest()
