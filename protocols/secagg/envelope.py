"""What clients send each other through the server: encrypted shares and signed key adverts.

The server relays every share from one client to a neighbour, so each pair of shares travels
inside an AEAD envelope the server cannot open: X25519 between the sender's and the receiver's
encryption keys (separate from the mask keys, whose private half is Shamir-shared: a
reconstructed mask key of a dropped client must not also open the shares addressed to it),
HKDF-SHA256 bound to the round and the ordered (sender, receiver) pair, then ChaCha20-Poly1305.
The associated data repeats round, sender and receiver, so an envelope replayed into another
round or relabelled to another pair fails to decrypt.

Key adverts are signed with the client's join identity (Ed25519, ``protocols/identity.py``)
when the run requires identities, over :func:`keys_message`; a peer checks the signature and
that the id is the one derived from the identity key, so the server cannot substitute keys.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from murmura.protocols.secagg.keys import _u64
from murmura.protocols.secagg.shamir import PRIME

#: Bytes of one share value: an element of GF(2**521 - 1).
Y_BYTES = 66
_NONCE = 12
_HEADER = struct.Struct("<IIH")  # sender, receiver, threshold
#: The plaintext of an envelope: header, self-seed share, mask-key share.
PLAINTEXT_BYTES = _HEADER.size + 2 * Y_BYTES
#: The client index a self-seed commitment is made under. Indices are assigned only after the
#: keys are advertised, so the commitment binds the seed to the round alone; the server checks a
#: reconstructed seed against it under the same constant.
COMMIT_INDEX = 1
#: The ciphertext of an envelope: nonce, plaintext, Poly1305 tag.
ENVELOPE_BYTES = _NONCE + PLAINTEXT_BYTES + 16


class EnvelopeError(ValueError):
    """An envelope that does not open, or opens to something malformed."""


@dataclass(frozen=True)
class SharePair:
    """The two shares a client holds of one neighbour's secrets, at its own x-coordinate."""

    sender: int
    receiver: int
    t: int
    self_y: int
    key_y: int


def _aead(private_key: X25519PrivateKey, peer_public: bytes, *, round_id: int, sender: int,
          receiver: int) -> tuple[ChaCha20Poly1305, bytes]:
    if len(peer_public) != 32:
        raise EnvelopeError(f"an X25519 public key has 32 bytes, got {len(peer_public)}")
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    aad = b"murmura/secagg/envelope/v1" + _u64(round_id) + struct.pack("<II", sender, receiver)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=aad).derive(shared)
    return ChaCha20Poly1305(key), aad


def _y_bytes(y: int) -> bytes:
    if not 0 <= y < PRIME:
        raise ValueError("a share value lies outside GF(2**521 - 1)")
    return y.to_bytes(Y_BYTES, "big")


def seal(private_key: X25519PrivateKey, peer_public: bytes, pair: SharePair, *,
         round_id: int) -> bytes:
    """Encrypt ``pair`` from ``pair.sender`` to ``pair.receiver`` (whose key is ``peer_public``)."""
    aead, aad = _aead(private_key, peer_public, round_id=round_id, sender=pair.sender,
                      receiver=pair.receiver)
    plain = _HEADER.pack(pair.sender, pair.receiver, pair.t) + _y_bytes(pair.self_y)
    plain += _y_bytes(pair.key_y)
    nonce = os.urandom(_NONCE)
    return nonce + aead.encrypt(nonce, plain, aad)


def open_envelope(private_key: X25519PrivateKey, peer_public: bytes, ciphertext: bytes, *,
                  round_id: int, sender: int, receiver: int) -> SharePair:
    """Decrypt an envelope ``sender`` addressed to ``receiver``; :class:`EnvelopeError` if it
    was altered, replayed from another round or pair, or holds a malformed share."""
    if len(ciphertext) != ENVELOPE_BYTES:
        raise EnvelopeError(f"an envelope has {ENVELOPE_BYTES} bytes, got {len(ciphertext)}")
    aead, aad = _aead(private_key, peer_public, round_id=round_id, sender=sender,
                      receiver=receiver)
    try:
        plain = aead.decrypt(ciphertext[:_NONCE], ciphertext[_NONCE:], aad)
    except InvalidTag:
        raise EnvelopeError(f"the envelope from {sender} does not authenticate") from None
    s, r, t = _HEADER.unpack_from(plain)
    if (s, r) != (sender, receiver):
        raise EnvelopeError("the envelope names another sender or receiver")
    self_y = int.from_bytes(plain[_HEADER.size:_HEADER.size + Y_BYTES], "big")
    key_y = int.from_bytes(plain[_HEADER.size + Y_BYTES:], "big")
    if not (self_y < PRIME and key_y < PRIME and t >= 1):
        raise EnvelopeError("the envelope holds a malformed share")
    return SharePair(sender=s, receiver=r, t=t, self_y=self_y, key_y=key_y)


def keys_message(*, round_id: int, client_id: str, mask_public_key: bytes,
                 enc_public_key: bytes, self_commitment: bytes) -> bytes:
    """The canonical bytes a client signs to advertise its round keys (domain-separated, every
    field length-prefixed, so a signature made for anything else never verifies here)."""
    out = b"murmura/secagg/keys/v1" + _u64(round_id)
    for part in (client_id.encode(), mask_public_key, enc_public_key, self_commitment):
        out += struct.pack("<I", len(part)) + part
    return out


__all__ = ["COMMIT_INDEX", "ENVELOPE_BYTES", "PLAINTEXT_BYTES", "Y_BYTES", "EnvelopeError",
           "SharePair", "keys_message", "open_envelope", "seal"]
