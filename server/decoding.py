"""The aggregation function: decode and check one update, wherever it runs.

Decoding is the expensive part of taking an update in (an int8 or top-k payload of a 10M-value
model costs tens of milliseconds, a seed-based update replays hundreds of steps over the whole
model), so the serverless tier runs it away from the gRPC event loop: in worker processes, on
Ray, or inline for tests and the simulator. Every backend runs this module's code, so they
cannot disagree about what a valid update is.

A :class:`Decoder` holds what decoding needs that is fixed for a run (model size, the run's
codec options, the seed pool); it is small and picklable, and worker processes cache the codec
objects it builds. :meth:`Decoder.decode` refuses malformed input with
:class:`~murmura.server.errors.InvalidArgument` and never returns a non-finite value.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from murmura.aggregation import Partial
from murmura.protocols import CodecError, FlatVector, TaskSettings, UnknownCodecError, create_codec
from murmura.protocols.codecs import Codec, one_torch_thread
from murmura.protocols.codecs.partial import PARTIAL_CODEC, PartialPayload, decode_partial
from murmura.protocols.codecs.seed import SeedCodec
from murmura.protocols.identity import payload_digest
from murmura.protocols.pool import seed_pool_for
from murmura.server.errors import FailedPrecondition, InvalidArgument
from murmura.server.slabs import SlabRef

if TYPE_CHECKING:
    from murmura.server.state import SpoolRef


@dataclass
class Decoded:
    """One decoded push: an update, or a leaf's partial aggregate.

    ``values`` is the update (model-sized; K pool coordinates in a seed-pool run) or a float32
    partial's weighted sum. A partial carries its own ``weight`` (the sum of its updates'
    weights) and ``count``; an exact partial carries integer ``limbs`` instead of ``values``.
    """

    values: FlatVector | None
    weight: float | None = None
    count: int = 1
    limbs: tuple[np.ndarray, np.ndarray] | None = None
    #: The largest magnitude among the values (a bound for exact limbs): the core bounds what
    #: one version's aggregate can reach with it, so no fold can overflow.
    max_abs: float = 0.0
    #: SHA-256 of the payload bytes, when the run checks update signatures (computed where the
    #: payload is decoded, so a large payload is never hashed on the gateway's event loop).
    payload_sha256: bytes | None = None
    #: The version the update was trained on and its example count, set when it is taken in:
    #: the buffer rule re-bases its buffers with them (server/model.py, BufferRule).
    base_version: int | None = None
    examples: float = 0.0
    #: Where ``values`` lie in shared memory (a worker decoded them into a slab), so that a
    #: worker can fold them without a copy (server/folds.py); None for in-process buffers.
    shared: SlabRef | None = None
    #: Where the payload lies in the durable spool, once taken (server/folds.py rebuilds a
    #: version from there if the workers' partial aggregate of it is damaged).
    spooled: SpoolRef | None = None
    #: The update's codec: set where a payload is only checked (see :attr:`from_payload`),
    #: and for every update when it is taken in.
    codec: str | None = None

    @property
    def is_partial(self) -> bool:
        return self.weight is not None

    @property
    def from_payload(self) -> bool:
        """Checked, not decoded (no ``values``): a worker folds it straight from its payload,
        the bytes at ``shared``, with ``codec`` (server/folds.py)."""
        return self.values is None and self.limbs is None and self.weight is None

    def as_partial(self) -> Partial:
        """A partial aggregate for the rule's ``merge`` (only when :attr:`is_partial`)."""
        assert self.weight is not None
        if self.limbs is not None:
            return Partial.from_arrays(weight=self.weight, count=self.count, limbs=self.limbs)
        return Partial.from_arrays(weight=self.weight, count=self.count, sum_f32=self.values)


@functools.lru_cache(maxsize=32)
def _codec(name: str, options: tuple[tuple[str, str], ...]) -> Codec:
    try:
        return create_codec(name, dict(options))
    except UnknownCodecError as exc:
        raise InvalidArgument(str(exc)) from None
    except CodecError as exc:
        raise InvalidArgument(f"codec {name!r} is misconfigured: {exc}") from None


@dataclass(frozen=True)
class Decoder:
    """Decodes this run's updates. ``size`` is the model's number of values."""

    size: int
    settings: TaskSettings
    #: Also hash each payload (SHA-256) for its signature check (``require_identity``).
    hash_payloads: bool = False

    @functools.cached_property
    def pool(self):  # noqa: ANN201 - SeedPool | None, built once per process
        return seed_pool_for(self.settings)

    def __getstate__(self) -> dict[str, object]:
        # Sent with every job to a worker: leave the cached pool behind (it is rebuilt there).
        state = dict(self.__dict__)
        state.pop("pool", None)
        return state

    @property
    def update_size(self) -> int:
        """Length of the vectors the policy aggregates: the model, or K pool coordinates."""
        return len(self.pool) if self.pool is not None else self.size

    def codec(self, name: str) -> Codec:
        # A client may pick its own codec; options are the server's settings for that codec.
        options = self.settings.codec_options if name == self.settings.codec else {}
        return _codec(name, tuple(sorted(options.items())))

    def needs_reference(self, codec: str) -> bool:
        """True when decoding ``codec`` needs the model version the update was trained on."""
        return codec != PARTIAL_CODEC and self.pool is None and self.codec(codec).needs_reference

    def decode(self, codec: str, payload: bytes | memoryview, *,
               reference: FlatVector | None = None, out: FlatVector | None = None) -> Decoded:
        """Decode and check one payload; :class:`InvalidArgument` says what is wrong.

        ``out`` (float32, the model's length) receives a model update in place when given (an
        aggregation worker's output slab); partials and pool updates ignore it.
        """
        decoded = self._decode(codec, payload, reference=reference, out=out)
        if self.hash_payloads:
            decoded.payload_sha256 = payload_digest(payload)
        return decoded

    def fusable(self, codec: str) -> bool:
        """Whether updates in ``codec`` can be checked now and folded from the payload later,
        never decoded into a model-sized vector (int8, int4, top-k of the model itself)."""
        return (codec != PARTIAL_CODEC and self.pool is None
                and getattr(self.codec(codec), "fusable", False))

    def check(self, codec: str, payload: bytes | memoryview) -> Decoded:
        """What :meth:`decode` checks (and the payload's hash), without decoding: the update
        is folded from the payload itself. For :meth:`fusable` codecs only."""
        c = self.codec(codec)
        try:
            top = c.check(payload, self.size)
        except CodecError as exc:
            raise InvalidArgument(f"payload does not decode: {exc}") from None
        decoded = Decoded(None, max_abs=top, codec=codec)
        if self.hash_payloads:
            decoded.payload_sha256 = payload_digest(payload)
        return decoded

    def _decode(self, codec: str, payload: bytes | memoryview, *,
                reference: FlatVector | None, out: FlatVector | None) -> Decoded:
        if codec == PARTIAL_CODEC:
            return self._partial(payload)
        if self.pool is not None:
            coefficients = self._pool_update(codec, payload)
            return Decoded(coefficients, max_abs=check_range(coefficients, "update"))
        c = self.codec(codec)
        if c.needs_reference and reference is None:
            raise FailedPrecondition(f"codec {codec!r} needs the model version the update was "
                                     f"trained on, which is no longer kept; train on the "
                                     f"current version")
        if out is not None and out.shape != (self.size,):
            out = None
        try:
            update, top = c.decode_bounded(payload, self.size, reference=reference, out=out)
        except CodecError as exc:
            raise InvalidArgument(f"payload does not decode: {exc}") from None
        if update.shape != (self.size,):
            raise InvalidArgument(f"update has {update.size} values; the model has {self.size}")
        # A codec that bounds its values from the payload (int8: the block scales) spares the
        # pass over the decoded vector; any other is checked here.
        return Decoded(update, max_abs=check_range(update, "update") if top is None else top)

    def _pool_update(self, codec: str, payload: bytes | memoryview) -> FlatVector:
        """A pool run's update: the K coefficients its steps applied along the pool seeds."""
        pool = self.pool
        c = self.codec(codec)
        if not isinstance(c, SeedCodec) or not c.pool_size:
            raise InvalidArgument(f"this run aggregates seed-pool updates (codec 'seed' with "
                                  f"pool={len(pool)}); codec {codec!r} without the pool cannot "
                                  f"be taken")
        try:
            update = pool.contribution(c.unpack(payload)).astype(np.float32)
        except CodecError as exc:
            raise InvalidArgument(f"payload does not decode: {exc}") from None
        if not np.isfinite(update).all():
            raise InvalidArgument("the update's pool coefficients overflow float32")
        return update

    def _partial(self, payload: bytes | bytearray | memoryview) -> Decoded:
        if self.pool is not None:
            raise InvalidArgument("a seed-pool run takes no partial aggregates")
        try:
            p: PartialPayload = decode_partial(payload, self.size)
        except CodecError as exc:
            raise InvalidArgument(f"partial aggregate does not decode: {exc}") from None
        if p.exact:
            assert p.limbs is not None  # set exactly when the kind is exact
            hi = p.limbs[0]
            # value = hi 2**-20 + lo 2**-80 with 0 <= lo < 2**60: |value| < (|hi| + 1) 2**-20
            top = float(max(int(hi.max()), -int(hi.min()))) + 1.0 if hi.size else 0.0
            return Decoded(None, weight=p.weight, count=p.count, limbs=p.limbs,
                           max_abs=top * 2.0 ** -20)
        assert p.sum_f32 is not None
        return Decoded(p.sum_f32, weight=p.weight, count=p.count,
                       max_abs=check_range(p.sum_f32, "partial aggregate"))


#: Below this many values NumPy's two passes cost less than torch's call overhead (measured:
#: 9 against 18 us at 10k values, parity near 1M; the simulator's small models live here).
_AMINMAX_FROM = 1 << 20
#: The ufuncs' own reductions: ``np.min``/``np.max`` add a Python wrapper that costs more than
#: the reduction itself on a small model (11.9 against 4.3 us for 650 values, the simulator's
#: logistic regression, once per update). Both propagate NaN, as ``check_range`` relies on.
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def _min_max(values: FlatVector) -> tuple[float, float]:
    """``(min, max)`` of a float32 vector, NaN if any value is NaN.

    ``torch.aminmax`` reads the vector once where NumPy's ``min`` and ``max`` read it twice
    (2.6 against 4.2 ms for 10M values on one core); it runs on one thread, as the server's
    folds do (``one_torch_thread``). Read-only arrays (torch would warn) and
    other dtypes, and vectors too small to gain, take NumPy's two passes.
    """
    if (values.size < _AMINMAX_FROM or values.dtype != np.float32 or values.ndim != 1
            or not values.flags.writeable or not values.flags.c_contiguous):
        return float(_MIN(values, axis=None)), float(_MAX(values, axis=None))
    with one_torch_thread():
        low, high = torch.aminmax(torch.from_numpy(values))
    return float(low), float(high)


def check_range(values: FlatVector, what: str) -> float:
    """The largest |value|, refusing NaN and Inf with the first bad index.

    NaN propagates through ``max`` and ``min``, so the reductions without a mask both find the
    magnitude and prove every value finite; only a bad vector needs the exact search.
    """
    if values.size == 0:
        return 0.0
    lowest, highest = _min_max(values)
    top = max(highest, -lowest)
    if not math.isfinite(top):
        finite = np.isfinite(values)
        bad = int(np.flatnonzero(~finite)[0]) if not finite.all() else 0
        raise InvalidArgument(f"{what} contains NaN or Inf (first at index {bad})")
    return top


__all__ = ["PARTIAL_CODEC", "Decoded", "Decoder", "check_range"]
