"""Update codecs: the registry and every built-in encoding (importing registers them)."""

from murmura.protocols.codecs import dense  # noqa: F401  (registers dense-f32, dense-f16)
from murmura.protocols.codecs.base import (
    Codec,
    CodecError,
    Encoder,
    UnknownCodecError,
    available_codecs,
    create_codec,
    register_codec,
)

__all__ = [
    "Codec",
    "CodecError",
    "Encoder",
    "UnknownCodecError",
    "available_codecs",
    "create_codec",
    "register_codec",
]
