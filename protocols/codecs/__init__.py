"""Update codecs: the registry and every built-in encoding (importing registers them)."""

# Importing a codec module registers its codecs.
from murmura.protocols.codecs import dense, partial, proj, quant, seed, sign, topk  # noqa: F401
from murmura.protocols.codecs._util import one_torch_thread
from murmura.protocols.codecs.base import (
    Codec,
    CodecError,
    Encoder,
    UnknownCodecError,
    available_codecs,
    create_codec,
    register_codec,
)
from murmura.protocols.codecs.partial import (
    PARTIAL_CODEC,
    PartialPayload,
    decode_partial,
    encode_partial,
)

__all__ = [
    "one_torch_thread",
    "PARTIAL_CODEC",
    "Codec",
    "CodecError",
    "Encoder",
    "PartialPayload",
    "UnknownCodecError",
    "available_codecs",
    "create_codec",
    "decode_partial",
    "encode_partial",
    "register_codec",
]
