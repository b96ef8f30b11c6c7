"""A peer's refusals: the shared hierarchy of :mod:`murmura.protocols.errors` (a peer and the
aggregator refuse the same way, with the same statuses and short messages)."""

from murmura.protocols.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
    quote,
)

#: A peer refused a message; nothing of the receiver's state changed.
GossipError = ServiceError

__all__ = ["Aborted", "FailedPrecondition", "GossipError", "InvalidArgument", "PermissionDenied",
           "ResourceExhausted", "Unauthenticated", "Unavailable", "quote"]
