"""The aggregator service: transport-agnostic core, round policies, gRPC servicer, outputs."""

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
