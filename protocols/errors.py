"""Refusals, each naming the gRPC status it maps to, for every service in Murmura.

The aggregator's core and a gossip peer raise these without knowing about gRPC; each servicer
maps ``status`` to ``grpc.StatusCode`` in one place, and the simulation's in-memory transport
raises them as they are. Messages say what was wrong and what was expected, and quote at most a
few dozen characters of the input (:func:`quote`).
"""

from __future__ import annotations

#: How many characters of an offending input a refusal may quote.
QUOTE = 32


def quote(value: object, limit: int = QUOTE) -> str:
    """``repr`` of at most ``limit`` characters of ``value``, saying how long it really was."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class ServiceError(Exception):
    """A request a service refuses; nothing in its state changed."""

    status = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: Set on refusals that go away by themselves (back-pressure): when to try again.
        self.retry_after_s = retry_after_s
        #: Whether the refusal was counted already (each is counted once, wherever it surfaces).
        self.counted = False

    def __reduce__(self) -> tuple:  # cross process boundaries (worker processes) intact
        return (_rebuild, (type(self), self.message, self.retry_after_s))


def _rebuild(cls: type[ServiceError], message: str, retry_after_s: float | None
             ) -> ServiceError:
    return cls(message, retry_after_s=retry_after_s)


class InvalidArgument(ServiceError):
    status = "INVALID_ARGUMENT"


class Unauthenticated(ServiceError):
    status = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    status = "PERMISSION_DENIED"


class FailedPrecondition(ServiceError):
    status = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError):
    status = "RESOURCE_EXHAUSTED"


class Aborted(ServiceError):
    """A conflicting operation is under way (the same update being taken in); retry."""

    status = "ABORTED"


class Unavailable(ServiceError):
    status = "UNAVAILABLE"
