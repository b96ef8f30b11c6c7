"""Compressed codecs: contract for every registered codec, then each codec's own promises."""

from __future__ import annotations

import struct

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Importing the modules registers the codecs.
from murmura.protocols.codecs import proj, quant, sign, topk  # noqa: F401
from murmura.protocols.codecs import seed as _seed  # noqa: F401
from murmura.protocols.codecs._util import HEADER_BYTES, MAGIC
from murmura.protocols.codecs.base import (
    Codec,
    CodecError,
    available_codecs,
    create_codec,
)

F32 = npt.NDArray[np.float32]


def _vector(size: int, seed: int = 0) -> F32:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def _roundtrip(codec: Codec, x: F32, *, seed: int = 0) -> tuple[bytes, F32]:
    payload = codec.encoder(x.size, seed=seed).encode(x)
    reference = np.zeros(x.size, dtype=np.float32) if codec.needs_reference else None
    return payload, codec.decode(payload, x.size, reference=reference)


def _decode(codec: Codec, payload: bytes, size: int) -> F32:
    reference = np.zeros(size, dtype=np.float32) if codec.needs_reference else None
    return codec.decode(payload, size, reference=reference)


# -- contract: every registered update codec -------------------------------------------------------

#: Registered names that do not carry client updates: ``partial`` only refuses the update path
#: (leaf aggregates travel through decode_partial; tests/protocols/test_partial_codec.py).
NOT_UPDATE_CODECS = {"partial"}
UPDATE_CODECS = [name for name in available_codecs() if name not in NOT_UPDATE_CODECS]


def test_every_other_codec_is_an_update_codec() -> None:
    assert NOT_UPDATE_CODECS <= set(available_codecs())
    assert len(UPDATE_CODECS) >= 8  # dense-f32/f16, int8/4, topk, sign, proj, seed


@pytest.mark.parametrize("name", UPDATE_CODECS)
class TestCodecContract:
    @pytest.mark.parametrize("size", [0, 1, 1001])
    def test_roundtrip_gives_a_finite_float32_vector_of_the_right_size(self, name: str,
                                                                      size: int) -> None:
        codec = create_codec(name)
        payload, decoded = _roundtrip(codec, _vector(size))
        assert decoded.dtype == np.float32 and decoded.shape == (size,)
        assert np.isfinite(decoded).all()
        bound = codec.max_payload_bytes(size)
        assert bound is None or len(payload) <= bound

    def test_decoding_is_deterministic_and_leaves_the_payload_alone(self, name: str) -> None:
        codec = create_codec(name)
        payload, first = _roundtrip(codec, _vector(500))
        copy = bytes(payload)
        assert np.array_equal(_decode(codec, payload, 500), first)
        assert payload == copy

    def test_truncated_extended_and_empty_payloads_are_refused(self, name: str) -> None:
        codec = create_codec(name)
        payload, _ = _roundtrip(codec, _vector(300))
        for bad in (payload[:-1], payload + b"\0", b"", payload[:3]):
            with pytest.raises(CodecError):
                _decode(codec, bad, 300)

    def test_wrong_size_is_refused(self, name: str) -> None:
        codec = create_codec(name)
        payload, _ = _roundtrip(codec, _vector(300))
        if name == "seed":  # the step log does not depend on the size; the reference does
            with pytest.raises(CodecError, match="reference"):
                codec.decode(payload, 301, reference=np.zeros(300, dtype=np.float32))
            return
        with pytest.raises(CodecError):  # a size whose payload length differs
            _decode(codec, payload, 30_000)

    @pytest.mark.parametrize("size", [1, 1001, 4096])
    def test_decode_into_writes_exactly_what_decode_returns(self, name: str, size: int) -> None:
        codec = create_codec(name)
        payload, decoded = _roundtrip(codec, _vector(size, seed=3))
        out = np.full(size, np.nan, dtype=np.float32)  # stale garbage must be overwritten
        reference = np.zeros(size, dtype=np.float32) if codec.needs_reference else None
        got = codec.decode_into(payload, out, reference=reference)
        assert got is out
        assert np.array_equal(out, decoded)

    def test_decode_into_refuses_what_decode_refuses(self, name: str) -> None:
        codec = create_codec(name)
        payload, _ = _roundtrip(codec, _vector(300))
        reference = np.zeros(300, dtype=np.float32) if codec.needs_reference else None
        with pytest.raises(CodecError):
            codec.decode_into(payload[:-1], np.empty(300, np.float32), reference=reference)

    def test_unknown_options_are_refused(self, name: str) -> None:
        with pytest.raises(CodecError, match="no_such_option|takes no options"):
            create_codec(name, {"no_such_option": "1"})

    def test_wrongly_shaped_updates_are_refused(self, name: str) -> None:
        encoder = create_codec(name).encoder(10)
        with pytest.raises(CodecError, match="shape"):
            encoder.encode(np.zeros(11, dtype=np.float32))


COMPRESSED = ["int8", "int4", "topk", "sign", "proj"]


@pytest.mark.parametrize("name", COMPRESSED)
class TestCompressedCodecs:
    def test_non_finite_updates_are_refused(self, name: str) -> None:
        x = _vector(100)
        x[42] = np.nan
        with pytest.raises(CodecError, match="index 42"):
            create_codec(name).encoder(100).encode(x)

    def test_payload_of_another_codec_is_refused(self, name: str) -> None:
        other = "sign" if name != "sign" else "topk"
        payload, _ = _roundtrip(create_codec(other), _vector(256))
        with pytest.raises(CodecError, match="another codec|bytes"):
            create_codec(name).decode(payload, 256)

    def test_bad_magic_and_version_are_refused(self, name: str) -> None:
        codec = create_codec(name)
        payload, _ = _roundtrip(codec, _vector(256))
        with pytest.raises(CodecError, match="magic"):
            codec.decode(bytes([MAGIC ^ 1]) + payload[1:], 256)
        with pytest.raises(CodecError, match="version"):
            codec.decode(payload[:2] + bytes([9]) + payload[3:], 256)

    def test_the_same_seed_gives_the_same_payload(self, name: str) -> None:
        codec, x = create_codec(name), _vector(700)
        assert codec.encoder(700, seed=5).encode(x) == codec.encoder(700, seed=5).encode(x)

    def test_zero_update_decodes_to_zero(self, name: str) -> None:
        _, decoded = _roundtrip(create_codec(name), np.zeros(513, dtype=np.float32))
        assert not decoded.any()


class TestPayloadSizes:
    @pytest.mark.parametrize(("name", "options", "size", "expected"), [
        ("int8", {}, 1000, 4 + 4 * 4 + 1000),
        ("int8", {"scale": "f16", "block": "100"}, 1000, 4 + 10 * 2 + 1000),
        ("int4", {}, 1001, 4 + 4 * 4 + 501),
        ("int4", {"scale": "f16"}, 1_000_000, 4 + 3907 * 2 + 500_000),
        # k = 10, l = 6: 60 low bits -> 8 bytes, 10 + (999 >> 6) = 25 high bits -> 4 bytes
        ("topk", {}, 1000, 4 + 10 * 4 + 8 + 4),
        # k = 10000, l = 6: 60000 bits -> 7500 bytes, 10000 + 15625 bits -> 3203 bytes
        ("topk", {"values": "f16"}, 1_000_000, 4 + 10000 * 2 + 7500 + 3203),
        ("sign", {}, 1000, 4 + 1 * 4 + 125),
        ("sign", {"block": "256"}, 1000, 4 + 4 * 4 + 125),
        ("sign", {"block": "1024", "scale": "f16"}, 1_000_000, 4 + 977 * 2 + 125_000),
        ("proj", {}, 1_000_000, 4 + 8 + 245 * 64 * 4),
        ("proj", {"block": "256", "k": "8", "values": "f16"}, 1000, 4 + 8 + 4 * 8 * 2),
        ("proj", {}, 100, 4 + 8 + 64 * 4),  # B shrinks to 128 for a short vector
    ])
    def test_payload_size_is_exactly_as_documented(self, name: str, options: dict[str, str],
                                                   size: int, expected: int) -> None:
        codec = create_codec(name, options)
        payload, _ = _roundtrip(codec, _vector(size))
        assert len(payload) == codec.max_payload_bytes(size) == expected


# -- int8 / int4 -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4"])
class TestQuantisation:
    def test_error_is_below_one_step_of_the_block_scale(self, name: str) -> None:
        # Prepare
        codec = create_codec(name, {"block": "64"})
        x = _vector(1000) * np.linspace(0.01, 10, 1000, dtype=np.float32)

        # Execute
        _, decoded = _roundtrip(codec, x)

        # Assert
        padded = np.zeros(1024, dtype=np.float32)
        padded[:1000] = np.abs(x)
        step = np.repeat(padded.reshape(16, 64).max(axis=1) / codec.levels, 64)[:1000]
        assert np.all(np.abs(decoded - x) <= step * (1 + 1e-5))

    @pytest.mark.parametrize("scale", ["f32", "f16"])
    def test_unbiased(self, name: str, scale: str) -> None:
        # Prepare: the per-coordinate standard deviation is at most step / 2
        codec, x, trials = create_codec(name, {"block": "32", "scale": scale}), _vector(256), 400
        encoder = codec.encoder(256, seed=3)

        # Execute
        mean = np.mean([codec.decode(encoder.encode(x), 256) for _ in range(trials)], axis=0)

        # Assert
        step = np.repeat(np.abs(x).reshape(8, 32).max(axis=1) / codec.levels, 32)
        assert np.all(np.abs(mean - x) < 5 * (step / 2) / np.sqrt(trials) + 1e-6)

    def test_nan_and_negative_scales_are_refused(self, name: str) -> None:
        codec = create_codec(name)
        payload, _ = _roundtrip(codec, _vector(600))
        with pytest.raises(CodecError, match="block scale 1 is nan"):
            codec.decode(payload[:8] + struct.pack("<f", np.nan) + payload[12:], 600)
        with pytest.raises(CodecError, match="block scale 2 is negative"):
            codec.decode(payload[:12] + struct.pack("<f", -1.0) + payload[16:], 600)
        with pytest.raises(CodecError, match="overflows"):
            codec.decode(payload[:4] + struct.pack("<f", 3e38) + payload[8:], 600)

    def test_scale_dtype_must_match(self, name: str) -> None:
        payload, _ = _roundtrip(create_codec(name, {"scale": "f16"}), _vector(100))
        with pytest.raises(CodecError, match="flags"):
            create_codec(name).decode(payload, 100)

    def test_float16_scale_overflow_is_refused(self, name: str) -> None:
        with pytest.raises(CodecError, match="float16"):
            create_codec(name, {"scale": "f16"}).encoder(3).encode(
                np.array([1e9, 0, 1], dtype=np.float32))

    @pytest.mark.parametrize("options", [{"block": "0"}, {"block": "x"}, {"scale": "f64"}])
    def test_options_are_validated(self, name: str, options: dict[str, str]) -> None:
        with pytest.raises(CodecError, match="option"):
            create_codec(name, options)


def test_int8_code_minus_128_is_refused() -> None:
    codec = create_codec("int8")
    payload, _ = _roundtrip(codec, _vector(10))
    with pytest.raises(CodecError, match="code -128 at index 3"):
        codec.decode(payload[:11] + b"\x80" + payload[12:], 10)


@pytest.mark.parametrize("name, options", [("int8", {}), ("int8", {"scale": "f16"}),
                                           ("int4", {"block": "100"})])
def test_large_payloads_decode_bit_identically_on_both_scaling_paths(
        name: str, options: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """From quant._TORCH_SCALE_FROM codes a writable payload is scaled in torch; NumPy's
    multiply (small or read-only payloads) must give the same bits, short last block too."""
    size = quant._TORCH_SCALE_FROM + 37
    codec = create_codec(name, options)
    x = (np.random.default_rng(3).standard_normal(size) * 1e-2).astype(np.float32)
    payload = codec.encoder(size, seed=0).encode(x)
    torch_path = codec.decode(memoryview(bytearray(payload)), size)
    monkeypatch.setattr(quant, "_TORCH_SCALE_FROM", size + 1)
    numpy_path = codec.decode(memoryview(bytearray(payload)), size)
    assert torch_path.dtype == numpy_path.dtype == np.float32
    assert np.array_equal(torch_path.view(np.int32), numpy_path.view(np.int32))
    assert np.array_equal(codec.decode(bytes(payload), size).view(np.int32),
                          numpy_path.view(np.int32))
    assert np.abs(torch_path - x).max() < 1e-2 * 6 / (127 if name == "int8" else 7)


def test_int4_packs_two_codes_per_byte_and_checks_nibbles() -> None:
    codec = create_codec("int4")
    payload, _ = _roundtrip(codec, _vector(5))
    codes = bytearray(payload)
    codes[8] &= 0xF0  # low nibble 0 means code -8
    with pytest.raises(CodecError, match="code -8 at index 0"):
        codec.decode(bytes(codes), 5)
    padded = bytearray(payload)
    padded[-1] |= 0x10  # size 5: the last high nibble is padding
    with pytest.raises(CodecError, match="padding nibble"):
        codec.decode(bytes(padded), 5)


# -- topk ----------------------------------------------------------------------------------------


class TestTopK:
    def test_keeps_exactly_the_largest_magnitudes(self) -> None:
        codec, x = create_codec("topk", {"ratio": "0.05", "feedback": "0"}), _vector(1000)
        _, decoded = _roundtrip(codec, x)
        largest = np.argsort(-np.abs(x))[:50]
        assert np.flatnonzero(decoded).tolist() == sorted(largest.tolist())
        assert np.array_equal(decoded[largest], x[largest])

    @pytest.mark.parametrize(("ratio", "size", "k"), [("0.07", 100, 7), ("0.01", 1000, 10),
                                                      ("0.01", 50, 1), ("1", 9, 9),
                                                      ("0.333", 1000, 333), ("1e-9", 10, 1)])
    def test_k_is_the_ceiling_of_ratio_times_size(self, ratio: str, size: int, k: int) -> None:
        assert topk.TopKCodec(ratio=ratio).k(size) == k

    @pytest.mark.parametrize("size", [1, 2, 3, 64, 1000, 4097])
    @pytest.mark.parametrize("ratio", ["0.001", "0.3", "1"])
    def test_elias_fano_roundtrip(self, size: int, ratio: str) -> None:
        k = topk.TopKCodec(ratio=ratio).k(size)
        indices = np.sort(np.random.default_rng(size).choice(size, k, replace=False))
        blob = topk.elias_fano_encode(indices.astype(np.int64), size)
        assert np.array_equal(topk.elias_fano_decode("topk", blob, 0, size, k), indices)

    def _forge(self, indices: list[int], size: int = 1000) -> bytes:
        codec = create_codec("topk")
        assert codec.k(size) == len(indices)
        header = _roundtrip(codec, _vector(size))[0][:4]
        values = np.ones(len(indices), dtype="<f4").tobytes()
        return header + values + topk.elias_fano_encode(np.array(indices, dtype=np.int64), size)

    def test_out_of_range_index_is_refused(self) -> None:
        payload = self._forge([0, 10, 20, 30, 40, 50, 60, 70, 80, 1010])
        with pytest.raises(CodecError, match=r"index 1010 at position 9 is out of range"):
            create_codec("topk").decode(payload, 1000)

    def test_duplicate_and_unsorted_indices_are_refused(self) -> None:
        duplicate = self._forge([0, 10, 20, 30, 30, 50, 60, 70, 80, 90])
        with pytest.raises(CodecError, match="position 4 .*duplicate"):
            create_codec("topk").decode(duplicate, 1000)
        unsorted = self._forge([0, 10, 20, 30, 40, 50, 70, 65, 80, 90])
        with pytest.raises(CodecError, match="index 65 at position 7 does not exceed"):
            create_codec("topk").decode(unsorted, 1000)

    def test_wrong_index_count_and_padding_are_refused(self) -> None:
        good = self._forge([0, 10, 20, 30, 40, 50, 60, 70, 80, 90])
        extra = bytearray(good)
        extra[-1] |= 0x01 << 0  # high bit 24: an 11th entry
        with pytest.raises(CodecError, match="11 entries, expected 10"):
            create_codec("topk").decode(bytes(extra), 1000)
        padding = bytearray(good)
        padding[-1] |= 0x80  # bit 31 lies after the 25 high bits
        with pytest.raises(CodecError, match="padding bits"):
            create_codec("topk").decode(bytes(padding), 1000)

    def test_nan_value_is_refused(self) -> None:
        payload = bytearray(self._forge([0, 10, 20, 30, 40, 50, 60, 70, 80, 90]))
        payload[4 + 4 * 3 : 4 + 4 * 4] = struct.pack("<f", np.inf)
        with pytest.raises(CodecError, match="value 3 is inf"):
            create_codec("topk").decode(bytes(payload), 1000)

    def test_float16_values_out_of_range_are_refused(self) -> None:
        with pytest.raises(CodecError, match="float16"):
            create_codec("topk", {"values": "f16"}).encoder(4).encode(
                np.array([0, 1e6, 0, 0], dtype=np.float32))

    @pytest.mark.parametrize("options", [{"ratio": "0"}, {"ratio": "1.5"}, {"ratio": "x"},
                                         {"values": "bf16"}, {"feedback": "maybe"}])
    def test_options_are_validated(self, options: dict[str, str]) -> None:
        with pytest.raises(CodecError, match="option"):
            create_codec("topk", options)


# -- error feedback ------------------------------------------------------------------------------


def _drifting_updates(size: int, rounds: int) -> list[F32]:
    """Updates with a consistent direction plus noise, like successive rounds of training."""
    rng = np.random.default_rng(7)
    drift = 0.1 * rng.standard_normal(size).astype(np.float32)
    return [drift + 0.3 * rng.standard_normal(size).astype(np.float32) for _ in range(rounds)]


@pytest.mark.parametrize(("name", "options"), [
    ("topk", {"ratio": "0.05"}),
    ("topk", {"ratio": "0.05", "values": "f16"}),
    ("sign", {}),
    ("sign", {"scale": "f16", "block": "100"}),
    ("proj", {"block": "256", "k": "32"}),
])
def test_error_feedback_makes_decoded_sums_track_true_sums(name: str,
                                                           options: dict[str, str]) -> None:
    # Prepare
    size, updates = 2000, _drifting_updates(2000, 60)
    errors = {}
    for feedback in ("1", "0"):
        codec = create_codec(name, {**options, "feedback": feedback})
        encoder = codec.encoder(size, seed=1)
        true_sum, decoded_sum = np.zeros(size), np.zeros(size)

        # Execute
        for update in updates:
            decoded_sum += codec.decode(encoder.encode(update), size)
            true_sum += update
        errors[feedback] = np.linalg.norm(true_sum - decoded_sum) / np.linalg.norm(true_sum)

        # Assert: with feedback, what is missing is exactly the residual
        if feedback == "1":
            residual = encoder.residual  # type: ignore[attr-defined]
            assert np.allclose(true_sum - decoded_sum, residual, atol=1e-4)
    assert errors["1"] < 0.3
    assert errors["0"] > 2 * errors["1"]


# -- sign ----------------------------------------------------------------------------------------


class TestSign:
    def test_decodes_to_the_block_mean_magnitude_with_the_right_signs(self) -> None:
        codec, x = create_codec("sign", {"block": "10", "feedback": "0"}), _vector(25)
        _, decoded = _roundtrip(codec, x)
        for start in range(0, 25, 10):
            block = x[start : start + 10]
            expected = np.where(block < 0, -1, 1) * np.abs(block).mean()
            assert np.allclose(decoded[start : start + 10], expected, rtol=1e-6)

    def test_nan_scale_and_padding_bits_are_refused(self) -> None:
        codec = create_codec("sign", {"block": "256"})
        payload, _ = _roundtrip(codec, _vector(300))
        with pytest.raises(CodecError, match="block scale 1 is nan"):
            codec.decode(payload[:8] + struct.pack("<f", np.nan) + payload[12:], 300)
        padded = bytearray(payload)
        padded[-1] |= 0x80  # 300 bits end at bit 4 of the last byte
        with pytest.raises(CodecError, match="padding bits"):
            codec.decode(bytes(padded), 300)

    @pytest.mark.parametrize("options", [{"block": "0"}, {"scale": "int"}, {"feedback": "2"}])
    def test_options_are_validated(self, options: dict[str, str]) -> None:
        with pytest.raises(CodecError, match="option"):
            create_codec("sign", options)


# -- proj ----------------------------------------------------------------------------------------


class TestProjection:
    def test_hadamard_is_orthogonal(self) -> None:
        h = proj.hadamard(64)
        assert np.array_equal(h @ h, 64 * np.eye(64, dtype=np.float32))

    def test_full_rank_projection_is_lossless(self) -> None:
        codec, x = create_codec("proj", {"block": "64", "k": "64"}), _vector(1000)
        _, decoded = _roundtrip(codec, x)
        assert np.allclose(decoded, x, atol=1e-5)

    def test_least_squares_decoding_is_an_orthogonal_projection(self) -> None:
        # Prepare
        codec, x = create_codec("proj", {"block": "256", "k": "32", "feedback": "0"}), _vector(4096)

        # Execute
        _, decoded = _roundtrip(codec, x)

        # Assert: the error is orthogonal to the reconstruction, which keeps about K/B of |x|^2
        for start in range(0, 4096, 256):
            part, rebuilt = x[start : start + 256], decoded[start : start + 256]
            assert abs(float(np.dot(part - rebuilt, rebuilt))) < 1e-3 * float(np.dot(part, part))
        kept = float(np.dot(decoded, decoded) / np.dot(x, x))
        assert 0.08 < kept < 0.17  # K / B = 0.125

    def test_unbiased_mode_averages_to_the_update(self) -> None:
        # Prepare: each decode has variance (B/K - 1)|x|^2 = 3|x|^2
        codec = create_codec("proj", {"block": "64", "k": "16", "mode": "unbiased"})
        x, trials = _vector(256), 300
        encoder = codec.encoder(256, seed=2)

        # Execute
        mean = np.mean([codec.decode(encoder.encode(x), 256) for _ in range(trials)], axis=0)

        # Assert: expected relative error sqrt(3 / 300) = 0.1
        assert np.linalg.norm(mean - x) / np.linalg.norm(x) < 0.16

    def test_bases_change_every_round(self) -> None:
        encoder = create_codec("proj").encoder(100)
        first, second = encoder.encode(_vector(100)), encoder.encode(_vector(100))
        assert first[4:12] != second[4:12]

    def test_bad_coefficients_and_mode_mismatch_are_refused(self) -> None:
        codec = create_codec("proj", {"block": "64", "k": "4"})
        payload, _ = _roundtrip(codec, _vector(128))
        with pytest.raises(CodecError, match="coefficient 1 is nan"):
            codec.decode(payload[:16] + struct.pack("<f", np.nan) + payload[20:], 128)
        with pytest.raises(CodecError, match="overflow"):
            codec.decode(payload[:12] + struct.pack("<f", 3e38) * 8, 128)
        unbiased = create_codec("proj", {"block": "64", "k": "4", "mode": "unbiased"})
        with pytest.raises(CodecError, match="flags"):
            unbiased.decode(payload, 128)

    @pytest.mark.parametrize("options", [
        {"block": "100"}, {"block": "1"}, {"block": str(1 << 17)}, {"block": "64", "k": "65"},
        {"k": "0"}, {"mode": "exact"}, {"mode": "unbiased", "feedback": "1"}, {"values": "f8"},
    ])
    def test_options_are_validated(self, options: dict[str, str]) -> None:
        with pytest.raises(CodecError, match="option|feedback"):
            create_codec("proj", options)


# -- decode_bounded: the largest |value| read from the payload --------------------------------


def _crafted_quant_payload(codec: Codec, scales: F32, codes: npt.NDArray[np.int8]) -> bytes:
    """A payload with the given scales and codes, valid as far as the decoder checks."""
    honest = codec.encoder(codes.size).encode(np.zeros(codes.size, dtype=np.float32))
    header = honest[:HEADER_BYTES]
    return header + scales.astype(codec.scale_dtype).tobytes() + codec._pack_codes(codes)


@pytest.mark.parametrize("name", UPDATE_CODECS)
def test_decode_bounded_gives_decode_and_the_exact_bound_or_none(name: str) -> None:
    codec = create_codec(name)
    payload, decoded = _roundtrip(codec, _vector(777))
    reference = np.zeros(777, dtype=np.float32) if codec.needs_reference else None
    out = np.full(777, np.nan, dtype=np.float32)

    update, top = codec.decode_bounded(payload, 777, reference=reference, out=out)

    assert update is out and np.array_equal(out, decoded)
    assert top is None or top == float(np.max(np.abs(decoded)))


@pytest.mark.parametrize("name", ["int8", "int4"])
class TestQuantBound:
    @settings(max_examples=150, deadline=None)
    @given(data=st.data())
    def test_bound_is_the_exact_largest_magnitude(self, name: str, data: st.DataObject) -> None:
        # Prepare: adversarial codes too: blocks with the largest scales may hold small codes,
        # so the bound must read past the first rows it inspects
        block = data.draw(st.sampled_from([1, 3, 8, 32]))
        size = data.draw(st.integers(1, 200 * block + 5))
        codec = create_codec(name, {"block": str(block)})
        levels, nblocks = codec.levels, -(-size // block)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        scales = rng.choice([0.0, 0.5, 1.0, 1.0 + 2**-20, 3.0], size=nblocks).astype(np.float32)
        caps = rng.integers(0, levels + 1, size=nblocks).repeat(block)[:size]
        codes = (rng.integers(-levels, levels + 1, size=size) % (caps + 1)
                 * rng.choice([-1, 1], size=size)).astype(np.int8)
        payload = _crafted_quant_payload(codec, scales, codes)

        # Execute
        update, top = codec.decode_bounded(payload, size)

        # Assert
        assert np.array_equal(update, codec.decode(payload, size))
        assert top == float(np.max(np.abs(update)))

    def test_rows_past_the_first_ones_read_are_checked(self, name: str) -> None:
        # Prepare: the 16 blocks with the largest scales hold only codes of 1; five blocks
        # with slightly smaller scales hold the true maximum; the rest cannot win
        codec = create_codec(name, {"block": "4"})
        levels = codec.levels
        scales = np.full(100, 0.01, dtype=np.float32)
        scales[:16], scales[40:45] = 2.0, 1.9
        codes = np.ones(400, dtype=np.int8)
        codes[40 * 4 + 2] = -levels
        payload = _crafted_quant_payload(codec, scales, codes)

        # Execute
        update, top = codec.decode_bounded(payload, 400)

        # Assert
        assert top == float(np.float32(1.9) * np.float32(levels)) == float(np.max(np.abs(update)))

    def test_bound_of_an_honest_large_update(self, name: str) -> None:
        codec = create_codec(name)
        x = _vector(100_000) * np.linspace(0.1, 5, 100_000, dtype=np.float32)
        payload = codec.encoder(x.size, seed=2).encode(x)
        update, top = codec.decode_bounded(payload, x.size)
        assert top == float(np.max(np.abs(update)))

    def test_out_of_the_wrong_size_is_refused(self, name: str) -> None:
        codec = create_codec(name)
        payload, _ = _roundtrip(codec, _vector(100))
        with pytest.raises(CodecError, match="out has 99 values"):
            codec.decode_bounded(payload, 100, out=np.empty(99, dtype=np.float32))


@pytest.mark.parametrize("codec", UPDATE_CODECS)
def test_encode_view_is_encode_without_the_copy_or_nothing(codec: str) -> None:
    # Prepare: a contiguous update and a strided one of the same values
    rng = np.random.default_rng(5)
    update = rng.normal(0, 0.1, 64).astype(np.float32)
    strided = np.repeat(update, 2)[::2]
    # Execute
    enc = create_codec(codec).encoder(64, seed=1)
    view = enc.encode_view(update)
    # Assert: dense-f32 gives the encoded bytes as a view of the update; the others give None
    if codec != "dense-f32":
        assert view is None
        return
    assert view is not None and bytes(view) == create_codec(codec).encoder(64).encode(update)
    assert np.shares_memory(np.frombuffer(view, np.uint8), update)
    other = enc.encode_view(strided)
    assert other is not None and bytes(other) == bytes(view)
    with pytest.raises(CodecError, match="expected \\(64,\\)"):
        enc.encode_view(update[:10])
