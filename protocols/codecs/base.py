"""Codec interface and registry.

A codec turns an update (a flat float32 vector, usually the difference between a client's
trained model and the global model it started from) into payload bytes and back. Encoding may
keep per-client state (error feedback, a random stream), so each client asks the codec for its
own :class:`Encoder`; decoding is stateless and validates everything it reads, since payloads
come from untrusted peers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import numpy.typing as npt

FlatVector = npt.NDArray[np.float32]


class CodecError(ValueError):
    """A payload or a codec option is malformed; the message says what and where."""


class UnknownCodecError(KeyError):
    """No codec is registered under this name."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown codec"


class Encoder(ABC):
    """Per-client encoding state for one codec."""

    @abstractmethod
    def encode(self, update: FlatVector) -> bytes:
        """Encode one update; may update internal state (e.g. an error-feedback residual)."""

    def encode_view(self, update: FlatVector) -> memoryview | None:
        """The payload :meth:`encode` would return, as a zero-copy view of ``update``'s own
        memory where the codec's bytes are exactly that memory (``dense-f32`` on a
        little-endian host); None for every other codec. The view aliases ``update``: the
        caller must not change it until the payload is sent."""
        return None


class Codec(ABC):
    """A named update encoding. Subclasses parse their options in ``__init__``."""

    name: ClassVar[str]
    #: True when decode needs the model the update was computed against (seed-based replay).
    needs_reference: ClassVar[bool] = False

    def __init__(self, **options: str) -> None:
        if options:
            raise CodecError(f"codec {self.name!r} takes no options, got {sorted(options)}")

    @abstractmethod
    def encoder(self, size: int, *, seed: int = 0) -> Encoder:
        """A fresh encoder for updates of ``size`` values."""

    @abstractmethod
    def decode(
        self, payload: bytes | memoryview, size: int, *, reference: FlatVector | None = None
    ) -> FlatVector:
        """Rebuild an update of ``size`` values; raise :class:`CodecError` on malformed input."""

    def decode_into(self, payload: bytes | memoryview, out: FlatVector, *,
                    reference: FlatVector | None = None) -> FlatVector:
        """:meth:`decode` into ``out`` (float32, the update's length), which is returned.

        An aggregation worker decodes straight into shared memory: a fresh 40 MB result per
        10M-value update would cost page faults and a copy. Codecs that can write in place
        override this; the default decodes, then copies. ``out`` may be partly written when
        the payload is refused.
        """
        update = self.decode(payload, out.size, reference=reference)
        if update.shape != out.shape:
            raise CodecError(f"codec {self.name!r}: decoded {update.size} values, expected "
                             f"{out.size}")
        np.copyto(out, update)
        return out

    def decode_bounded(self, payload: bytes | memoryview, size: int, *,
                       reference: FlatVector | None = None, out: FlatVector | None = None
                       ) -> tuple[FlatVector, float | None]:
        """The update (into ``out`` when given, as :meth:`decode_into`) and, when the codec can
        tell from the payload alone, the largest ``|value|`` in it; None otherwise.

        A server bounds every aggregate with that maximum and refuses NaN and Inf; a codec that
        returns a number guarantees every value is finite and the number is exactly
        ``max(abs(update))``, so the caller can skip its own pass over the decoded vector
        (``int8``: 5 of the 14 ms a 10M-value update took). The default knows nothing.
        """
        if out is None:
            return self.decode(payload, size, reference=reference), None
        return self.decode_into(payload, out, reference=reference), None

    def max_payload_bytes(self, size: int) -> int | None:
        """Exact or upper bound on a payload's size for ``size`` values, when known."""
        return None

    #: True when the codec can check a payload without decoding it (:meth:`check`) and fold
    #: it straight into an accumulator (:meth:`fold_into`): no model-sized temporary per
    #: update on the server.
    fusable: ClassVar[bool] = False

    def check(self, payload: bytes | memoryview, size: int) -> float:
        """Check ``payload`` as :meth:`decode_bounded` does, without writing the update; the
        largest ``|value|`` it holds (every value is then finite). Fusable codecs only."""
        raise NotImplementedError(f"codec {self.name!r} cannot check without decoding")

    def fold_into(self, payload: bytes | memoryview, old: FlatVector, new: FlatVector,
                  alpha: float) -> bool:
        """Fold ``alpha * update`` into an accumulator, for a payload :meth:`check` accepted.

        Writes ``old + alpha * update`` into ``new`` and returns False, or, where the update
        touches few values, adds into ``old`` in place (``new`` untouched) and returns True.
        Either way the result equals decoding first and adding with ``alpha`` after, bit for
        bit. Fusable codecs only.
        """
        raise NotImplementedError(f"codec {self.name!r} cannot fold without decoding")

    def sparse(self, payload: bytes | memoryview, size: int
               ) -> tuple[npt.NDArray[np.int64], FlatVector] | None:
        """``(indices, values)`` of an update that sets few values (unique indices), for a
        payload :meth:`check` accepted; None for a dense codec. A server folds such an update
        in place, keeping the values it overwrites so that a retried fold can undo a partial
        one (server/folds.py)."""
        return None


_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` available under ``cls.name``; duplicates fail loudly."""
    name = getattr(cls, "name", None)
    if not name:
        raise ValueError(f"{cls.__name__} has no codec name")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"codec {name!r} is already registered by {_REGISTRY[name].__name__}")
    _REGISTRY[name] = cls
    return cls


def create_codec(name: str, options: Mapping[str, str] | None = None) -> Codec:
    """Instantiate the codec registered under ``name`` with string options."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownCodecError(
            f"unknown codec {name!r}; available: {', '.join(available_codecs())}"
        ) from None
    return cls(**dict(options or {}))


def available_codecs() -> list[str]:
    return sorted(_REGISTRY)


def parse_float_option(codec: str, options: dict[str, str], key: str, default: float,
                       *, low: float, high: float) -> float:
    """Pop ``key`` from options as a float in [low, high], with a clear error otherwise."""
    raw = options.pop(key, None)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CodecError(f"codec {codec!r}: option {key}={raw!r} is not a number") from None
    if not (low <= value <= high):
        raise CodecError(f"codec {codec!r}: option {key}={value} must lie in [{low}, {high}]")
    return value


def parse_int_option(codec: str, options: dict[str, str], key: str, default: int,
                     *, low: int, high: int) -> int:
    """Pop ``key`` from options as an int in [low, high], with a clear error otherwise."""
    raw = options.pop(key, None)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise CodecError(f"codec {codec!r}: option {key}={raw!r} is not an integer") from None
    if not (low <= value <= high):
        raise CodecError(f"codec {codec!r}: option {key}={value} must lie in [{low}, {high}]")
    return value


def reject_leftover_options(codec: str, options: dict[str, str]) -> None:
    if options:
        raise CodecError(f"codec {codec!r}: unknown option(s) {sorted(options)}")


def check_payload_length(codec: str, payload: bytes | memoryview, expected: int) -> None:
    if len(payload) != expected:
        raise CodecError(
            f"codec {codec!r}: payload is {len(payload)} bytes, expected {expected}"
        )
