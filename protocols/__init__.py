"""The wire: murmura.proto and its stubs, plain message types, ModelSpec and update codecs."""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
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

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "Codec": "murmura.protocols.codecs",
    "CodecError": "murmura.protocols.codecs",
    "Encoder": "murmura.protocols.codecs",
    "UnknownCodecError": "murmura.protocols.codecs",
    "available_codecs": "murmura.protocols.codecs",
    "create_codec": "murmura.protocols.codecs",
    "register_codec": "murmura.protocols.codecs",
    "PROTOCOL_VERSION": "murmura.protocols.messages",
    "Action": "murmura.protocols.messages",
    "DeviceProfile": "murmura.protocols.messages",
    "JoinProof": "murmura.protocols.messages",
    "JoinResult": "murmura.protocols.messages",
    "PeerInfo": "murmura.protocols.messages",
    "PeerModelHeader": "murmura.protocols.messages",
    "PushResult": "murmura.protocols.messages",
    "Task": "murmura.protocols.messages",
    "TaskSettings": "murmura.protocols.messages",
    "UpdateHeader": "murmura.protocols.messages",
    "FlatVector": "murmura.protocols.spec",
    "ModelSpec": "murmura.protocols.spec",
    "TensorSpec": "murmura.protocols.spec",
}

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


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
