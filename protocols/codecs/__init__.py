"""Update codecs: the registry and every built-in encoding (importing registers them)."""

# Importing a codec module registers its codecs.
from murmura.protocols.codecs import dense, proj, quant, seed, sign, topk  # noqa: F401
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
