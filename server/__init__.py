"""The aggregator service: transport-agnostic core, round policies, gRPC servicer, outputs."""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
    from murmura.server.app import AggregatorServer, ServerThread, build_core
    from murmura.server.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from murmura.server.config import ServerConfig
    from murmura.server.core import AggregatorCore, ClientRecord, evaluator_for
    from murmura.server.errors import (
        FailedPrecondition,
        InvalidArgument,
        PermissionDenied,
        ResourceExhausted,
        ServiceError,
        Unauthenticated,
    )
    from murmura.server.outputs import RunRecorder
    from murmura.server.state import AggregatorState, MemoryState
    from murmura.server.store import SqliteState

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "AggregatorServer": "murmura.server.app",
    "ServerThread": "murmura.server.app",
    "build_core": "murmura.server.app",
    "Checkpoint": "murmura.server.checkpoint",
    "load_checkpoint": "murmura.server.checkpoint",
    "save_checkpoint": "murmura.server.checkpoint",
    "ServerConfig": "murmura.server.config",
    "AggregatorCore": "murmura.server.core",
    "ClientRecord": "murmura.server.core",
    "evaluator_for": "murmura.server.core",
    "FailedPrecondition": "murmura.server.errors",
    "InvalidArgument": "murmura.server.errors",
    "PermissionDenied": "murmura.server.errors",
    "ResourceExhausted": "murmura.server.errors",
    "ServiceError": "murmura.server.errors",
    "Unauthenticated": "murmura.server.errors",
    "RunRecorder": "murmura.server.outputs",
    "AggregatorState": "murmura.server.state",
    "MemoryState": "murmura.server.state",
    "SqliteState": "murmura.server.store",
}

__all__ = [
    "AggregatorState",
    "MemoryState",
    "SqliteState",
    "AggregatorCore",
    "AggregatorServer",
    "Checkpoint",
    "ClientRecord",
    "FailedPrecondition",
    "InvalidArgument",
    "PermissionDenied",
    "ResourceExhausted",
    "RunRecorder",
    "ServerConfig",
    "ServerThread",
    "ServiceError",
    "Unauthenticated",
    "build_core",
    "evaluator_for",
    "load_checkpoint",
    "save_checkpoint",
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
