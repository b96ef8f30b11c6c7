"""Typed refusals of a peer, each naming the gRPC status the servicer answers with."""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "Aborted",
    "FailedPrecondition",
    "GossipError",
    "InvalidArgument",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "short",
]


def short(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: refusals never echo much of the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GossipError(Exception):
    """A peer refused a message; nothing of the receiver's state changed."""

    status: ClassVar[str] = "UNKNOWN"


class InvalidArgument(GossipError):
    status = "INVALID_ARGUMENT"


class FailedPrecondition(GossipError):
    status = "FAILED_PRECONDITION"


class PermissionDenied(GossipError):
    status = "PERMISSION_DENIED"


class ResourceExhausted(GossipError):
    status = "RESOURCE_EXHAUSTED"


class Aborted(GossipError):
    """Not now: the sender should retry after a pause (e.g. a step log for a round the
    receiver has not started)."""

    status = "ABORTED"


class Unavailable(GossipError):
    status = "UNAVAILABLE"
