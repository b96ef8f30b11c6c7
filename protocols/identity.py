"""Node identities: Ed25519 keys, client ids derived from them, and the signed messages.

A node (a client, a leaf's upstream link, later a gossip peer) holds an Ed25519 private key.
Its id is a function of its public key (:func:`client_id_for`), so nobody can use an id
without the key behind it. Two things are signed, each over a canonical, domain-separated
encoding so that a signature made for one purpose never verifies for another:

* joining: ``join_message(nonce, client_id, public_key)``, where the nonce is a single-use
  challenge from the server, so a captured Join cannot be replayed;
* every update: ``update_message(...)`` over the session, update id, base version, round,
  example count, codec, SHA-256 of the payload and the model spec's fingerprint, so an update
  captured in one session does not verify in another, and a changed byte or field is caught.

This module is transport-neutral and pure apart from reading and writing key files.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import struct
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
    "client_id_for",
    "join_message",
    "load_public_keys",
    "parse_public_key",
    "payload_digest",
    "peer_message",
    "update_message",
    "verify",
]

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
#: Every derived id starts with this, so a derived id is never mistaken for a chosen name.
CLIENT_ID_PREFIX = "n-"
_JOIN_DOMAIN = b"murmura/join/v1"
_UPDATE_DOMAIN = b"murmura/update/v1"
_ID_DOMAIN = b"murmura/client-id/v1"
_PEER_DOMAIN = b"murmura/peer/v1"


class IdentityError(ValueError):
    """A key file or a public key is missing, unreadable or malformed."""


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


def update_message(*, session: str, update_id: str, base_version: int, round: int,
                   num_examples: int, codec: str, payload_sha256: bytes,
                   spec_fingerprint: str) -> bytes:
    """What a node signs for one update (everything that decides how it counts)."""
    return _fields(_UPDATE_DOMAIN, session, update_id, base_version, round, num_examples, codec,
                   payload_sha256, spec_fingerprint)


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
    """True when ``signature`` is ``public_key``'s Ed25519 signature of ``message``."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
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
        """``header`` with this key's signature (see :func:`update_message`)."""
        message = update_message(session=header.session, update_id=header.update_id,
                                 base_version=header.base_version, round=header.round,
                                 num_examples=header.num_examples, codec=header.codec,
                                 payload_sha256=payload_sha256,
                                 spec_fingerprint=header.spec_fingerprint)
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
    """A public key from its 64 hex characters (what ``.pub`` files and allow-lists hold)."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise IdentityError(f"expected an Ed25519 public key as {2 * PUBLIC_KEY_BYTES} hex "
                            f"characters, got {text[:24]!r}")
    return raw


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
