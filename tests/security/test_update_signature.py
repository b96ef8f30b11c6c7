"""The update signature covers every field of UpdateHeader (but itself) and the payload hash.

The field list comes from ``dataclasses.fields(UpdateHeader)``: a field added later fails
``test_every_header_field_is_covered_or_listed_as_unsigned`` until it is either covered by
``signed_update_message`` (and given a changed value in ``CHANGED``) or listed in ``UNSIGNED``
with the reason it need not be signed.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.protocols import UpdateHeader
from murmura.protocols.identity import (
    NodeKey,
    payload_digest,
    signed_update_message,
    verify,
)
from murmura.protocols.serde import update_header_from_proto, update_header_to_proto

KEY = NodeKey.from_seed("update-signature")
PAYLOAD = np.arange(4, dtype="<f4").tobytes()
DIGEST = payload_digest(PAYLOAD)
HEADER = UpdateHeader(session="sess", update_id="u1", base_version=3, num_examples=10,
                      codec="dense-f32", payload_bytes=len(PAYLOAD), round=2,
                      metrics={"loss": 0.5, "acc": 0.75}, spec_fingerprint="fp")

#: Fields the signature does not cover, and why.
UNSIGNED = {"signature": "the signature cannot sign itself"}

#: For every signed field, values differing from HEADER's (metrics: each kind of change).
CHANGED: dict[str, list[object]] = {
    "session": ["sess2", "", "Sess"],
    "update_id": ["u2", ""],
    "base_version": [4, 0, -3],
    "num_examples": [11, 0, 10_000_000],
    "codec": ["int8", ""],
    "payload_bytes": [len(PAYLOAD) + 1, 0],
    "round": [3, 0],
    "metrics": [
        {"loss": 0.25, "acc": 0.75},                 # a value changed
        {"loss": 0.5, "acc": np.nextafter(0.75, 1)},  # by one ulp
        {"lost": 0.5, "acc": 0.75},                  # a name changed
        {"loss": 0.5},                               # a metric removed
        {"loss": 0.5, "acc": 0.75, "f1": 0.0},       # a metric added
        {"loss": 0.75, "acc": 0.5},                  # values swapped between names
        {},
    ],
    "spec_fingerprint": ["fp2", ""],
}


def changed_headers() -> list[tuple[str, UpdateHeader]]:
    return [(name, dataclasses.replace(HEADER, **{name: value}))
            for name, values in CHANGED.items() for value in values]


def test_every_header_field_is_covered_or_listed_as_unsigned() -> None:
    names = {f.name for f in dataclasses.fields(UpdateHeader)}
    assert not set(CHANGED) & set(UNSIGNED)
    assert names == set(CHANGED) | set(UNSIGNED), (
        f"UpdateHeader fields {sorted(names - set(CHANGED) - set(UNSIGNED))} are neither "
        f"signed (add them to signed_update_message and CHANGED) nor listed in UNSIGNED; "
        f"stale entries: {sorted(set(CHANGED) | set(UNSIGNED) - names)}")


@pytest.mark.parametrize(("name", "header"), changed_headers(),
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(changed_headers())])
def test_changing_any_signed_field_fails_verification(name: str, header: UpdateHeader) -> None:
    signed = KEY.sign_update(HEADER, DIGEST)
    assert verify(KEY.public_bytes, signed.signature, signed_update_message(signed, DIGEST))
    tampered = dataclasses.replace(header, signature=signed.signature)
    assert signed_update_message(tampered, DIGEST) != signed_update_message(signed, DIGEST)
    assert not verify(KEY.public_bytes, tampered.signature,
                      signed_update_message(tampered, DIGEST)), name


def test_a_changed_payload_or_another_key_fails_verification() -> None:
    signed = KEY.sign_update(HEADER, DIGEST)
    other = payload_digest(PAYLOAD[:-1] + b"\x01")
    assert not verify(KEY.public_bytes, signed.signature, signed_update_message(signed, other))
    by_other = NodeKey.from_seed("someone else").sign_update(HEADER, DIGEST)
    assert not verify(KEY.public_bytes, by_other.signature, signed_update_message(HEADER, DIGEST))
    with pytest.raises(ValueError, match="32 bytes"):
        signed_update_message(HEADER, DIGEST[:16])


def test_no_two_different_headers_share_a_message() -> None:
    headers = [HEADER] + [h for _, h in changed_headers()]
    messages = [signed_update_message(h, DIGEST) for h in headers]
    assert len(set(messages)) == len(messages)


def test_the_signature_itself_is_not_signed_and_metric_order_does_not_matter() -> None:
    signed = KEY.sign_update(HEADER, DIGEST)
    assert signed_update_message(signed, DIGEST) == signed_update_message(HEADER, DIGEST)
    reordered = dataclasses.replace(HEADER, metrics=dict(reversed(HEADER.metrics.items())))
    assert list(reordered.metrics) != list(HEADER.metrics)
    assert signed_update_message(reordered, DIGEST) == signed_update_message(HEADER, DIGEST)


def test_field_boundaries_cannot_be_confused() -> None:
    def message(**changes: object) -> bytes:
        return signed_update_message(dataclasses.replace(HEADER, **changes), DIGEST)

    # moving bytes across a boundary between two strings
    assert message(session="ab", update_id="c") != message(session="a", update_id="bc")
    assert message(codec="x", spec_fingerprint="") != message(codec="", spec_fingerprint="x")
    # a metric versus a codec string holding that metric's encoded bytes
    metric_bytes = (struct.pack(">I", 1) + struct.pack(">I", 1) + b"a" + struct.pack(">d", 1.0))
    assert message(codec="c", metrics={"a": 1.0}) != \
        message(codec="c" + metric_bytes.decode("latin-1"), metrics={})
    assert message(codec="c", metrics={"a": 1.0}) != \
        message(codec="c", metrics={}, spec_fingerprint=metric_bytes.decode("latin-1") + "fp")
    # a metric name versus a longer name holding its value's bytes
    assert message(metrics={"a": 1.0, "b": 2.0}) != message(metrics={"a": 1.0})
    assert message(metrics={"ab": 1.0}) != message(metrics={"a": 1.0, "b": 1.0})
    # -0.0 and 0.0 are different bytes; every NaN is one value
    assert message(metrics={"a": 0.0}) != message(metrics={"a": -0.0})
    nan2 = struct.unpack(">d", bytes.fromhex("7ff8000000000001"))[0]
    assert message(metrics={"a": float("nan")}) == message(metrics={"a": nan2})
    # swapping equal-typed integer fields
    assert message(base_version=2, round=3) != message(base_version=3, round=2)
    assert message(num_examples=4, payload_bytes=5) != message(num_examples=5, payload_bytes=4)


def test_the_message_is_domain_separated_v2() -> None:
    message = signed_update_message(HEADER, DIGEST)
    assert message.startswith(struct.pack(">H", 17) + b"murmura/update/v2")


def test_numpy_integers_and_floats_sign_as_their_python_values() -> None:
    numpy_header = dataclasses.replace(HEADER, base_version=np.int64(3), round=np.int32(2),
                                       num_examples=np.int64(10),
                                       payload_bytes=np.uint16(len(PAYLOAD)),
                                       metrics={"loss": np.float32(0.5), "acc": np.float64(0.75)})
    assert signed_update_message(numpy_header, DIGEST) == signed_update_message(HEADER, DIGEST)


def test_a_signed_header_survives_the_protobuf_round_trip() -> None:
    header = dataclasses.replace(HEADER, metrics={"loss": 0.1, "acc": -0.0, "n": 1e300,
                                                  "tiny": 5e-324, "é": 1.0})
    signed = KEY.sign_update(header, DIGEST)
    back = update_header_from_proto(update_header_to_proto(signed))
    assert back.signature == signed.signature
    assert signed_update_message(back, DIGEST) == signed_update_message(signed, DIGEST)
    assert verify(KEY.public_bytes, back.signature, signed_update_message(back, DIGEST))


_text = st.text(max_size=6)
_headers = st.builds(
    UpdateHeader, session=_text, update_id=_text, base_version=st.integers(-2, 2),
    num_examples=st.integers(0, 3), codec=_text, payload_bytes=st.integers(0, 3),
    round=st.integers(0, 2),
    metrics=st.dictionaries(st.text(max_size=3), st.floats(allow_nan=False, width=64),
                            max_size=3),
    spec_fingerprint=_text)


@settings(max_examples=300, deadline=None)
@given(_headers, _headers)
def test_different_headers_never_share_a_message(a: UpdateHeader, b: UpdateHeader) -> None:
    # dict equality takes 0.0 == -0.0; the encoding keeps them apart (stricter, never looser)
    if a != b:
        assert signed_update_message(a, DIGEST) != signed_update_message(b, DIGEST)
