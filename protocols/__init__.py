"""The wire: murmura.proto and its stubs, plain message types, ModelSpec and update codecs."""

from murmura.protocols.codecs import (
    Codec,
    CodecError,
    Encoder,
    UnknownCodecError,
    available_codecs,
    create_codec,
    register_codec,
)
from murmura.protocols.messages import (
    PROTOCOL_VERSION,
    Action,
    DeviceProfile,
    JoinProof,
    JoinResult,
    PeerInfo,
    PeerModelHeader,
    PushResult,
    Task,
    TaskSettings,
    UpdateHeader,
)
from murmura.protocols.spec import FlatVector, ModelSpec, TensorSpec

__all__ = [
    "PROTOCOL_VERSION",
    "Action",
    "Codec",
    "CodecError",
    "DeviceProfile",
    "Encoder",
    "FlatVector",
    "JoinProof",
    "JoinResult",
    "ModelSpec",
    "PeerInfo",
    "PeerModelHeader",
    "PushResult",
    "Task",
    "TaskSettings",
    "TensorSpec",
    "UnknownCodecError",
    "UpdateHeader",
    "available_codecs",
    "create_codec",
    "register_codec",
]
