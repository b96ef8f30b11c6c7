"""The aggregator's refusals: the shared hierarchy of :mod:`murmura.protocols.errors`."""

from murmura.protocols.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)

__all__ = ["Aborted", "FailedPrecondition", "InvalidArgument", "PermissionDenied",
           "ResourceExhausted", "ServiceError", "Unauthenticated", "Unavailable"]
