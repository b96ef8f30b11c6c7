"""Refusals, each naming the gRPC status it maps to, for every service in Murmura.

The aggregator's core and a gossip peer raise these without knowing about gRPC; each servicer
maps ``status`` to ``grpc.StatusCode`` in one place, and the simulation's in-memory transport
raises them as they are. Messages say what was wrong and what was expected, and quote at most a
few dozen characters of the input (:func:`quote`).
"""

from __future__ import annotations

import re

#: How many characters of an offending input a refusal may quote.
QUOTE = 32

#: The particulars of a message (quoted input, numbers) that :func:`short_reason` drops.
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"-?\b\d[\w.]*")


def quote(value: object, limit: int = QUOTE) -> str:
    """``repr`` of at most ``limit`` characters of ``value``, saying how long it really was.

    Escapes count too: a character outside the Basic Multilingual Plane reprs as 10
    (``\U0001f600``), so fewer characters are kept where the repr would pass 4 x ``limit``.
    """
    text = str(value)
    kept = text[:limit]
    shown = repr(kept)
    while len(shown) > 4 * limit + 2 and kept:
        kept = kept[:-1]
        shown = repr(kept)
    if kept == text:
        return shown
    return f"{shown}… ({len(text)} characters)"


class ServiceError(Exception):
    """A request a service refuses; nothing in its state changed."""

    status = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        #: Set on refusals that go away by themselves (back-pressure): when to try again.
        self.retry_after_s = retry_after_s
        #: A short key that refusals of one kind share ("too stale"): the counts in the
        #: metrics and summary.json are grouped by it; empty: :func:`short_reason` of the
        #: message.
        self.reason = reason
        #: Whether the refusal was counted already (each is counted once, wherever it surfaces).
        self.counted = False

    @property
    def key(self) -> str:
        """``STATUS: reason``, what the refusal is counted under (``refused_by_reason``)."""
        return f"{self.status}: {self.reason or short_reason(self.message)}"

    def __reduce__(self) -> tuple:  # cross process boundaries (worker processes) intact
        return (_rebuild, (type(self), self.message, self.retry_after_s, self.reason))


def _rebuild(cls: type[ServiceError], message: str, retry_after_s: float | None,
             reason: str = "") -> ServiceError:
    return cls(message, retry_after_s=retry_after_s, reason=reason)


def short_reason(message: str) -> str:
    """A refusal's message without its particulars: the part before the first ``;``, ``:``
    or ``(``, quoted input and numbers replaced, at most eight words. Refusals of one kind
    then share one key, so 1,408 stale updates are one line of summary.json, not 1,408."""
    head = re.split(r"[;:(]", message, maxsplit=1)[0]
    head = _NUMBER.sub("N", _QUOTED.sub("…", head))
    return " ".join(head.split()[:8]) or "no reason given"


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
