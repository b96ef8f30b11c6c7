"""Which FedKSeed seed pool, if any, a run's settings imply (shared by server and clients)."""

from __future__ import annotations

from murmura.protocols.codecs import create_codec
from murmura.protocols.codecs.seed import SeedCodec, SeedPool
from murmura.protocols.messages import TaskSettings

#: ``ModelHeader.codec`` of a Pull that carries the pool's cumulative scalars (K float32).
POOL_SCALARS_CODEC = "pool-f32"


def seed_pool_for(settings: TaskSettings) -> SeedPool | None:
    """The run's seed pool: set when clients train zeroth-order with codec ``seed`` and option
    ``pool`` = K > 0; None otherwise (the global model then travels whole)."""
    if settings.trainer != "zo" or settings.codec != "seed":
        return None
    codec = create_codec("seed", settings.codec_options)
    assert isinstance(codec, SeedCodec)
    return codec.pool(settings.seed)


__all__ = ["POOL_SCALARS_CODEC", "seed_pool_for"]
