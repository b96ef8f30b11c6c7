"""Who sent a message: binding peer ids to addresses, with a hook for signatures.

Today a peer id is bound to the first address a peer learns for it; a message that claims a
bound id from another address is refused (PERMISSION_DENIED) while the bound address still
answers Health, and rebinds the id when it does not (a restarted peer comes back on a new
port). Signed identities (``protocols/identity.py``, built separately) plug in through
``verify``: a callable ``(peer_id, signature, body) -> bool`` checked before any binding, so a
valid signature can later replace the liveness probe entirely.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from murmura.gossip.errors import InvalidArgument, PermissionDenied, quote

log = logging.getLogger(__name__)

__all__ = ["AddressBinding", "Verifier", "check_well_formed", "well_formed"]

Verifier = Callable[[str, bytes, bytes], bool]
MAX_ID_CHARS = 128
MAX_ADDRESS_CHARS = 256


def well_formed(peer_id: str, address: str) -> bool:
    """Whether an id and address could be a peer's: a printable id of 1..128 characters and
    a HOST:PORT address of at most 256."""
    return (0 < len(peer_id) <= MAX_ID_CHARS and peer_id.isprintable()
            and 0 < len(address) <= MAX_ADDRESS_CHARS and ":" in address)


def check_well_formed(peer_id: str, address: str) -> None:
    """:func:`well_formed`, as a refusal that says which part is wrong."""
    if not peer_id or len(peer_id) > MAX_ID_CHARS or not peer_id.isprintable():
        raise InvalidArgument(f"peer id must be 1..{MAX_ID_CHARS} printable characters, "
                              f"got {quote(peer_id)}")
    if not address or ":" not in address or len(address) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"peer address must be HOST:PORT, got {quote(address)}")


class AddressBinding:
    """peer id -> address, first come; rebinding only when the old address is dead."""

    def __init__(self, owner: str, *, is_alive: Callable[[str, str], bool],
                 verify: Verifier | None = None, max_entries: int = 100_000) -> None:
        self.owner = owner
        self.is_alive = is_alive  # (peer_id, address) -> whether that peer answers there
        self.verify = verify
        self.max_entries = max_entries
        self._bound: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, peer_id: str, address: str, *, signature: bytes = b"",
              body: bytes = b"") -> None:
        """Raise a typed refusal unless ``peer_id`` at ``address`` is believable."""
        check_well_formed(peer_id, address)
        if peer_id == self.owner:
            raise PermissionDenied(f"a peer at {quote(address)} claims this peer's own id")
        if self.verify is not None and not self.verify(peer_id, signature, body):
            raise PermissionDenied(f"signature check failed for peer {quote(peer_id)}")
        with self._lock:
            bound = self._bound.get(peer_id)
            if bound is None or bound == address:
                self._bind(peer_id, address)
                return
        # the id is bound elsewhere: refuse while the bound peer is alive (probe off the lock)
        if self.is_alive(peer_id, bound):
            raise PermissionDenied(f"peer id {quote(peer_id)} is bound to another live address")
        log.info("peer %s moved from %s to %s (the old address is dead)", peer_id, bound,
                 address)
        with self._lock:
            self._bind(peer_id, address)

    def _bind(self, peer_id: str, address: str) -> None:
        self._bound[peer_id] = address
        self._bound.move_to_end(peer_id)
        while len(self._bound) > self.max_entries:
            self._bound.popitem(last=False)

    def address_of(self, peer_id: str) -> str | None:
        with self._lock:
            return self._bound.get(peer_id)
