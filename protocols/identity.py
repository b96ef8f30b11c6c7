"""Node identities: Ed25519 keys, client ids derived from them, and the signed messages.

A node (a client, a leaf's upstream link, later a gossip peer) holds an Ed25519 private key.
Its id is a function of its public key (:func:`client_id_for`), so nobody can use an id
without the key behind it. Two things are signed, each over a canonical, domain-separated
encoding so that a signature made for one purpose never verifies for another:

* joining: ``join_message(nonce, client_id, public_key)``, where the nonce is a single-use
  challenge from the server, so a captured Join cannot be replayed;
* every update: ``signed_update_message(header, payload_sha256)`` over every field of the
  :class:`~murmura.protocols.messages.UpdateHeader` but the signature itself (session, update
  id, base version, round, example count, codec, payload size, metrics, spec fingerprint) and
  the payload's SHA-256, so an update captured in one session does not verify in another, and
  a changed byte or field is caught.

Public keys are checked before use (:func:`check_public_key`): a non-canonical encoding, a
point off the curve or a point of small order is refused, because a small-order key makes
forgery trivial with a cofactorless verifier such as OpenSSL's: under the identity point,
(R = identity, S = 0) verifies for every message; under the other seven, a few tries suffice.

This module is transport-neutral and pure apart from reading and writing key files.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import math
import operator
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from murmura.protocols.messages import JoinProof, UpdateHeader

__all__ = [
    "CLIENT_ID_PREFIX",
    "IdentityError",
    "NodeKey",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "check_public_key",
    "client_id_for",
    "join_message",
    "load_public_keys",
    "parse_public_key",
    "payload_digest",
    "peer_message",
    "signed_update_message",
    "verify",
]

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
#: Every derived id starts with this, so a derived id is never mistaken for a chosen name.
CLIENT_ID_PREFIX = "n-"
_JOIN_DOMAIN = b"murmura/join/v1"
_UPDATE_DOMAIN = b"murmura/update/v2"
_ID_DOMAIN = b"murmura/client-id/v1"
_PEER_DOMAIN = b"murmura/peer/v1"


class IdentityError(ValueError):
    """A key file or a public key is missing, unreadable or malformed."""


# -- public key validation: Ed25519 (RFC 8032) in plain integers ---------------------------

_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)  # a square root of -1 mod p
_Y_MASK = (1 << 255) - 1


def _decode_point(raw: bytes) -> tuple[int, int]:
    """The affine point ``(x, y)`` that 32 bytes encode (RFC 8032, 5.1.3), or IdentityError."""
    n = int.from_bytes(raw, "little")
    y, sign = n & _Y_MASK, n >> 255
    if y >= _P:
        raise IdentityError("invalid Ed25519 public key: its y coordinate is not below "
                            "2^255-19 (a non-canonical encoding)")
    yy = y * y % _P
    u, v = (yy - 1) % _P, (_D * yy + 1) % _P  # x^2 = u / v; v != 0 as d is not a square
    # a candidate square root of u / v with a single exponentiation (RFC 8032, 5.1.3)
    v3 = v * v * v % _P
    x = u * v3 * pow(u * v3 * v3 * v % _P, (_P - 5) // 8, _P) % _P
    vxx = v * x * x % _P
    if vxx == (-u) % _P:
        x = x * _SQRT_M1 % _P
    elif vxx != u:
        raise IdentityError("invalid Ed25519 public key: not a point on the curve")
    if x == 0 and sign:
        raise IdentityError("invalid Ed25519 public key: x = 0 with the sign bit set "
                            "(a non-canonical encoding)")
    if x & 1 != sign:
        x = _P - x
    return x, y


def _is_small_order(x: int, y: int) -> bool:
    """Whether 8 * (x, y) is the identity, i.e. the point's order divides 8. Three doublings
    in extended coordinates (RFC 8032, 5.1.4; X, Y, Z only: doubling does not need T)."""
    px, py, pz = x, y, 1
    for _ in range(3):
        a, b = px * px % _P, py * py % _P
        c = 2 * pz * pz % _P
        h = (a + b) % _P
        e = (h - (px + py) * (px + py)) % _P
        g = (a - b) % _P
        f = (c + g) % _P
        px, py, pz = e * f % _P, g * h % _P, f * g % _P
    return px == 0 and py == pz  # (0, Z, Z) is the identity; Z never vanishes (complete)


def _key_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not an acceptable Ed25519 public key, or None."""
    if len(raw) != PUBLIC_KEY_BYTES:
        return f"invalid Ed25519 public key: it has {len(raw)} bytes, not {PUBLIC_KEY_BYTES}"
    return _point_problem(raw)


@functools.lru_cache(maxsize=4096)
def _point_problem(raw: bytes) -> str | None:
    """:func:`_key_problem` for 32 bytes (cached: the same keys come back with every push)."""
    try:
        x, y = _decode_point(raw)
    except IdentityError as exc:
        return str(exc)
    if _is_small_order(x, y):
        return ("invalid Ed25519 public key: a point of small order (1, 2, 4 or 8), under "
                "which signatures can be forged")
    return None


def check_public_key(raw: bytes) -> bytes:
    """``raw`` as bytes if it is an acceptable Ed25519 public key; otherwise IdentityError,
    whose one-line message (starting ``invalid Ed25519 public key:``) says why: the wrong
    length, a y coordinate not below 2^255-19, no point on the curve for that y, x = 0 with
    the sign bit set, or a point of small order (the eight torsion points, in any encoding).

    Keys with a small-order component added to a real key are accepted: they cannot forge
    another key's signatures and RFC 8032 accepts them."""
    raw = bytes(raw)
    problem = _key_problem(raw)
    if problem is not None:
        raise IdentityError(problem)
    return raw


def client_id_for(public_key: bytes) -> str:
    """The id of the node holding ``public_key``: ``n-`` and 26 base32 characters (130 bits
    of SHA-256), short enough for logs and file names, printable, and stable for a key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise IdentityError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, "
                            f"got {len(public_key)}")
    digest = hashlib.sha256(_ID_DOMAIN + public_key).digest()
    return CLIENT_ID_PREFIX + base64.b32encode(digest).decode("ascii")[:26].lower()


def _fields(domain: bytes, *parts: bytes | str | int) -> bytes:
    """Length-prefixed fields after a domain tag: no two different tuples encode alike."""
    out = [struct.pack(">H", len(domain)), domain]
    for part in parts:
        if isinstance(part, int):
            data = struct.pack(">q", part)
        elif isinstance(part, str):
            data = part.encode("utf-8")
        else:
            data = bytes(part)
        out.append(struct.pack(">I", len(data)))
        out.append(data)
    return b"".join(out)


def join_message(nonce: bytes, client_id: str, public_key: bytes) -> bytes:
    """What a joining node signs: the server's challenge bound to its id and key."""
    return _fields(_JOIN_DOMAIN, nonce, client_id, public_key)


def _metrics_bytes(metrics: Mapping[str, float]) -> bytes:
    """A canonical encoding of an update's metrics: the entry count, then each entry sorted
    by its name's UTF-8 bytes as the length-prefixed name and the value's 8-byte big-endian
    IEEE 754 double (every NaN as the one quiet NaN, so a NaN's payload bits do not matter)."""
    entries = []
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names are strings, got {type(name).__name__}")
        number = float(value)
        entries.append((name.encode("utf-8"), math.nan if math.isnan(number) else number))
    entries.sort()
    out = [struct.pack(">I", len(entries))]
    for key, number in entries:
        out += [struct.pack(">I", len(key)), key, struct.pack(">d", number)]
    return b"".join(out)


def signed_update_message(header: UpdateHeader, payload_sha256: bytes) -> bytes:
    """What a node signs for one update: every field of ``header`` but its signature (session,
    update id, base version, round, example count, codec, payload size, metrics, spec
    fingerprint) and the SHA-256 of the payload, under the ``murmura/update/v2`` domain."""
    if len(payload_sha256) != hashlib.sha256().digest_size:
        raise ValueError(f"a payload's SHA-256 has 32 bytes, got {len(payload_sha256)}")
    # operator.index: a numpy integer becomes an int (never bytes(n), n zero bytes)
    return _fields(_UPDATE_DOMAIN, header.session, header.update_id,
                   operator.index(header.base_version), operator.index(header.round),
                   operator.index(header.num_examples), header.codec,
                   operator.index(header.payload_bytes), _metrics_bytes(header.metrics),
                   header.spec_fingerprint, bytes(payload_sha256))


def peer_message(kind: str, peer_id: str, address: str, public_key: bytes,
                 *parts: bytes | str | int) -> bytes:
    """What a gossip peer signs: the message kind (``exchange``, ``push``, ``goodbye``), who
    sends it from where with which key, and the fields that decide what the message does
    (for a push: message id, round, examples, codec, spec and the payload's SHA-256)."""
    return _fields(_PEER_DOMAIN, kind, peer_id, address, public_key, *parts)


def payload_digest(payload: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of an update's payload bytes."""
    return hashlib.sha256(payload).digest()


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s Ed25519 signature of ``message``; always
    False for a key :func:`check_public_key` refuses (a small-order key verifies forgeries)."""
    public_key = bytes(public_key)
    if len(signature) != SIGNATURE_BYTES or _key_problem(public_key) is not None:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class NodeKey:
    """An Ed25519 private key and what follows from it (public key, client id)."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> NodeKey:
        """A fresh key (an ephemeral identity unless saved)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str | bytes) -> NodeKey:
        """A key that is a function of ``seed``: for tests and reproducible experiments only
        (whoever knows the seed holds the key), e.g. reruns whose fold order, which follows
        client ids, must not change."""
        raw = seed.encode() if isinstance(seed, str) else bytes(seed)
        return cls(Ed25519PrivateKey.from_private_bytes(
            hashlib.sha256(b"murmura/test-key/v1" + raw).digest()))

    @property
    def public_bytes(self) -> bytes:
        return self.private.public_key().public_bytes(serialization.Encoding.Raw,
                                                      serialization.PublicFormat.Raw)

    @property
    def public_hex(self) -> str:
        return self.public_bytes.hex()

    @property
    def client_id(self) -> str:
        return client_id_for(self.public_bytes)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def join_proof(self, nonce: bytes) -> JoinProof:
        """Proof for a Join under :attr:`client_id`, over the server's challenge ``nonce``."""
        public = self.public_bytes
        return JoinProof(public_key=public, nonce=nonce,
                         signature=self.sign(join_message(nonce, client_id_for(public), public)))

    def sign_update(self, header: UpdateHeader, payload_sha256: bytes) -> UpdateHeader:
        """``header`` with this key's signature (see :func:`signed_update_message`)."""
        message = signed_update_message(header, payload_sha256)
        return dataclasses.replace(header, signature=self.sign(message))

    def save(self, path: str | Path) -> Path:
        """Write the private key (PKCS#8 PEM, mode 0600) and ``PATH.pub`` (the public key in
        hex, one line, the format of an allow-list); refuses to overwrite."""
        path = Path(path)
        pem = self.private.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise IdentityError(f"{path} already exists; not overwriting a key") from None
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        pub = path.with_name(path.name + ".pub")
        pub.write_text(f"{self.public_hex}  # {self.client_id}\n")
        return pub

    @classmethod
    def load(cls, path: str | Path) -> NodeKey:
        """Read a key written by :meth:`save` (``murmura keys new``)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read key file {path}: {exc.strerror}") from None
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise IdentityError(f"{path} is not an unencrypted PEM private key "
                                f"(make one with: murmura keys new --out FILE)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)


def parse_public_key(text: str) -> bytes:
    """A public key from its 64 hex characters (what ``.pub`` files and allow-lists hold),
    refused unless :func:`check_public_key` accepts it."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise IdentityError(f"expected an Ed25519 public key as {2 * PUBLIC_KEY_BYTES} hex "
                            f"characters, got {text[:24]!r}")
    return check_public_key(raw)


def load_public_keys(path: str | Path) -> frozenset[bytes]:
    """An allow-list file: one hex public key per line; ``#`` starts a comment."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IdentityError(f"cannot read allow-list {path}: {exc}") from None
    keys = set()
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            keys.add(parse_public_key(text))
        except IdentityError as exc:
            raise IdentityError(f"{path}:{n}: {exc}") from None
    return frozenset(keys)
