"""The partial-aggregate wire format: round trips of both kinds, every malformed payload refused
with CodecError, and the ``partial`` registry entry that refuses the update path."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.aggregation import Partial, WeightedMean
from murmura.aggregation import partial as aggregation_partial
from murmura.protocols.codecs import (
    PARTIAL_CODEC,
    CodecError,
    available_codecs,
    create_codec,
    decode_partial,
    encode_partial,
)
from murmura.protocols.codecs import partial as codec_partial
from murmura.protocols.codecs._util import MAGIC

HEADER = 24

weights_st = st.floats(1e-300, 1e300)
counts_st = st.integers(1, (1 << 64) - 1)
f32_sums_st = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                       min_size=1, max_size=40).map(lambda v: np.array(v, dtype=np.float32))
limbs_st = st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(-(1 << 62) + 1, (1 << 62) - 1), min_size=n, max_size=n),
    st.lists(st.integers(0, (1 << 60) - 1), min_size=n, max_size=n),
)).map(lambda hl: (np.array(hl[0], dtype=np.int64), np.array(hl[1], dtype=np.int64)))


def _f32_payload(size: int = 6, weight: float = 12.5, count: int = 3) -> bytes:
    return encode_partial(weight=weight, count=count,
                          sum_f32=np.arange(size, dtype=np.float32) - 2)


def _exact_payload(size: int = 6) -> bytes:
    hi = np.arange(size, dtype=np.int64) - 3
    lo = np.arange(size, dtype=np.int64) * 1000
    return encode_partial(weight=7.0, count=2, limbs=(hi, lo))


def _patch(payload: bytes, offset: int, fmt: str, value: object) -> bytes:
    out = bytearray(payload)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


# -- round trips -------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(f32_sums_st, weights_st, counts_st)
def test_float32_partials_round_trip(sum_f32, weight: float, count: int) -> None:
    # Execute
    payload = encode_partial(weight=weight, count=count, sum_f32=sum_f32)
    decoded = decode_partial(payload, sum_f32.size)

    # Assert
    assert len(payload) == HEADER + 4 * sum_f32.size
    assert decoded.weight == weight and decoded.count == count and not decoded.exact
    assert decoded.limbs is None and decoded.sum_f32 is not None
    assert decoded.sum_f32.dtype == np.float32 and decoded.size == sum_f32.size
    assert decoded.sum_f32.tobytes() == sum_f32.tobytes()


@settings(max_examples=80, deadline=None)
@given(limbs_st, weights_st, counts_st)
def test_exact_partials_round_trip(limbs, weight: float, count: int) -> None:
    payload = encode_partial(weight=weight, count=count, limbs=limbs)
    decoded = decode_partial(payload, limbs[0].size)
    assert len(payload) == HEADER + 16 * limbs[0].size
    assert decoded.weight == weight and decoded.count == count and decoded.exact
    assert decoded.sum_f32 is None and decoded.limbs is not None
    for got, sent in zip(decoded.limbs, limbs, strict=True):
        assert got.dtype == np.int64 and np.array_equal(got, sent)


def test_decoded_arrays_are_read_only_views_of_a_bytes_payload() -> None:
    for payload in (_f32_payload(), _exact_payload()):
        decoded = decode_partial(payload, 6)
        arrays = [decoded.sum_f32] if decoded.sum_f32 is not None else list(decoded.limbs or ())
        assert arrays and all(not a.flags.writeable for a in arrays)


def test_an_aggregators_partial_survives_the_wire_bit_for_bit(rng) -> None:
    # Prepare: a leaf of each kind
    for exact in (False, True):
        leaf = WeightedMean(300, exact=exact)
        for _ in range(5):
            leaf.add(rng.normal(size=300).astype(np.float32), float(rng.integers(1, 90)),
                     factor=float(rng.uniform()))
        sent = leaf.partial()

        # Execute: encode, decode from a memoryview (as out of a receive buffer), rebuild
        payload = encode_partial(**sent.as_arrays())
        got = decode_partial(memoryview(bytearray(payload)), 300)
        received = Partial.from_arrays(weight=got.weight, count=got.count,
                                       sum_f32=got.sum_f32, limbs=got.limbs)

        # Assert
        assert received.exact == exact and received.count == 5
        assert received.weight == sent.weight
        assert received.mean().tobytes() == sent.mean().tobytes()


def test_the_limb_layout_matches_the_exact_accumulator() -> None:
    assert codec_partial.LIMB_BITS == aggregation_partial.LIMB_BITS
    assert codec_partial.HI_LIMIT == aggregation_partial.EXACT_LIMIT


# -- malformed payloads ------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "size", "match"), [
    (lambda: b"", 6, "shorter than the 24-byte header"),
    (lambda: _f32_payload()[:HEADER - 1], 6, "shorter than the 24-byte header"),
    (lambda: _f32_payload()[:-1], 6, "payload is 47 bytes, expected 48"),
    (lambda: _f32_payload() + b"\0", 6, "payload is 49 bytes, expected 48"),
    (lambda: _exact_payload()[:-8], 6, r"expected 120 for 6 exact values"),
    (lambda: _f32_payload(), 7, "holds 6 values, the model has 7"),
    (lambda: _f32_payload(), 0, "size must be positive"),
    (lambda: _patch(_f32_payload(), 0, "<B", MAGIC ^ 1), 6, "magic"),
    (lambda: _patch(_f32_payload(), 1, "<B", ord("s")), 6, "not a partial aggregate"),
    (lambda: _patch(_f32_payload(), 2, "<B", 2), 6, "unsupported format version 2"),
    (lambda: _patch(_f32_payload(), 3, "<B", 2), 6, "unknown kind 2"),
    # the kind says exact but the length is a float32 sum's
    (lambda: _patch(_f32_payload(), 3, "<B", 1), 6, "expected 120 for 6 exact values"),
    (lambda: _patch(_f32_payload(), 8, "<d", math.nan), 6, "weight must be finite and > 0"),
    (lambda: _patch(_f32_payload(), 8, "<d", math.inf), 6, "weight must be finite and > 0"),
    (lambda: _patch(_f32_payload(), 8, "<d", 0.0), 6, "weight must be finite and > 0"),
    (lambda: _patch(_f32_payload(), 8, "<d", -3.0), 6, "weight must be finite and > 0"),
    (lambda: _patch(_f32_payload(), 16, "<Q", 0), 6, "count must be >= 1"),
    (lambda: _patch(_f32_payload(), HEADER + 4 * 2, "<f", math.nan), 6, "sum value 2 is nan"),
    (lambda: _patch(_f32_payload(), HEADER + 4 * 5, "<f", -math.inf), 6,
     "sum value 5 is -inf"),
    (lambda: _patch(_exact_payload(), HEADER + 48 + 8 * 4, "<q", -1), 6,
     r"lo limb 4 is -1, outside \[0, 2\*\*60\)"),
    (lambda: _patch(_exact_payload(), HEADER + 48 + 8 * 1, "<q", 1 << 60), 6, "lo limb 1"),
    (lambda: _patch(_exact_payload(), HEADER + 8 * 3, "<q", 1 << 62), 6,
     "hi limb 3 .* range"),
    (lambda: _patch(_exact_payload(), HEADER, "<q", -(1 << 62)), 6, "hi limb 0 .* range"),
])
def test_malformed_payloads_are_refused(make, size: int, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_partial(make(), size)


def test_a_payload_of_an_update_codec_is_refused() -> None:
    codec = create_codec("sign")
    payload = codec.encoder(600).encode(np.ones(600, dtype=np.float32))
    with pytest.raises(CodecError, match="not a partial aggregate|bytes"):
        decode_partial(payload, 600)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "exactly one of sum_f32"),
    ({"sum_f32": np.zeros(2, np.float32), "limbs": (np.zeros(2, np.int64),) * 2},
     "exactly one of sum_f32"),
    ({"sum_f32": np.zeros(2, np.float64)}, "float32"),
    ({"sum_f32": np.zeros((2, 2), np.float32)}, "1-d"),
    ({"sum_f32": np.zeros(0, np.float32)}, "non-empty"),
    ({"sum_f32": np.array([0, np.inf], np.float32)}, "sum value 1 is inf"),
    ({"sum_f32": np.zeros(2, np.float32), "weight": 0.0}, "weight"),
    ({"sum_f32": np.zeros(2, np.float32), "weight": math.nan}, "weight"),
    ({"sum_f32": np.zeros(2, np.float32), "weight": True}, "weight"),
    ({"sum_f32": np.zeros(2, np.float32), "count": 0}, "count"),
    ({"sum_f32": np.zeros(2, np.float32), "count": 1 << 64}, "count"),
    ({"sum_f32": np.zeros(2, np.float32), "count": 2.0}, "count"),
    ({"limbs": (np.zeros(2, np.int64), np.zeros(3, np.int64))}, "one length"),
    ({"limbs": (np.zeros(2, np.int32), np.zeros(2, np.int64))}, "int64"),
    ({"limbs": (np.zeros(2, np.int64),) * 3}, "pair"),
    ({"limbs": (np.zeros(2, np.int64), np.array([0, -5], np.int64))}, "lo limb 1 is -5"),
    ({"limbs": (np.array([1 << 62, 0], np.int64), np.zeros(2, np.int64))}, "hi limb 0"),
])
def test_encoding_refuses_what_decoding_would(kwargs: dict, match: str) -> None:
    args = {"weight": 1.0, "count": 1, **kwargs}
    with pytest.raises(CodecError, match=match):
        encode_partial(**args)


# -- the registry entry ------------------------------------------------------------------------


def test_the_partial_codec_refuses_the_update_path_with_a_clear_message() -> None:
    assert PARTIAL_CODEC in available_codecs()
    codec = create_codec(PARTIAL_CODEC)
    with pytest.raises(CodecError, match="decode_partial.*aggregator that accepts partials"):
        codec.decode(_f32_payload(), 6)
    with pytest.raises(CodecError, match="encode_partial"):
        codec.encoder(6)
    with pytest.raises(CodecError, match="takes no options"):
        create_codec(PARTIAL_CODEC, {"x": "1"})
