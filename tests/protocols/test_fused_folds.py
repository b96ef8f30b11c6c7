"""Fusable codecs: ``check`` judges a payload as decoding does, and ``fold_into`` adds the
decoded update without materialising it, with the bits a decode-then-add gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.protocols import create_codec
from murmura.protocols.codecs import CodecError

CODECS = [("int8", {}), ("int4", {}), ("int8", {"block": "7", "scale": "f16"}),
          ("topk", {"ratio": "0.1"}), ("topk", {"ratio": "0.3", "values": "f16"})]


def _dense_fold(codec, payload: bytes, old: np.ndarray, alpha: float) -> np.ndarray:
    """What the server did before: decode into a vector, then one fused add."""
    update = codec.decode(memoryview(bytearray(payload)), old.size)
    acc = torch.from_numpy(old.copy())
    acc.add_(torch.from_numpy(update), alpha=alpha)
    return acc.numpy()


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1),
       alpha=st.floats(1e-3, 1e3), which=st.integers(0, len(CODECS) - 1))
def test_check_and_fold_into_agree_with_decoding(size: int, seed: int, alpha: float,
                                                 which: int) -> None:
    name, opts = CODECS[which]
    codec = create_codec(name, opts)
    rng = np.random.default_rng(seed)
    update = (rng.standard_normal(size) * 10.0 ** rng.integers(-4, 2, size)).astype(np.float32)
    payload = codec.encoder(size, seed=seed).encode(update)
    decoded, top = codec.decode_bounded(memoryview(bytearray(payload)), size)
    expected_top = top if top is not None else float(np.max(np.abs(decoded)))
    assert codec.check(memoryview(bytearray(payload)), size) == expected_top
    old = rng.standard_normal(size).astype(np.float32)
    want = _dense_fold(codec, payload, old, alpha)
    acc, new = old.copy(), np.full(size, np.nan, np.float32)
    in_place = codec.fold_into(memoryview(bytearray(payload)), acc, new, alpha)
    got = acc if in_place else new
    if name == "topk":  # a scatter-add rounds alpha * value on its own: two roundings
        bound = 2 * np.finfo(np.float32).eps * (np.abs(old) + alpha * np.abs(decoded))
        assert np.all(np.abs(got.astype(np.float64) - want) <= bound)
        assert in_place
    else:
        assert np.array_equal(got, want) and not in_place
        assert np.array_equal(acc, old)  # the old half is only read


@pytest.mark.parametrize("name,opts", CODECS)
def test_check_refuses_what_decoding_refuses(name: str, opts: dict[str, str]) -> None:
    codec = create_codec(name, opts)
    payload = bytearray(codec.encoder(100, seed=1).encode(np.ones(100, np.float32)))
    with pytest.raises(CodecError):
        codec.check(memoryview(payload[:-1]), 100)  # truncated
    bad = bytearray(payload)
    bad[0] ^= 0xFF  # wrong tag
    with pytest.raises(CodecError):
        codec.check(memoryview(bad), 100)
    if name.startswith("int"):  # a scale of NaN must not pass as a bound
        bad = bytearray(payload)
        bad[4:8] = np.array([np.nan], np.float32).tobytes()
        with pytest.raises(CodecError):
            codec.check(memoryview(bad), 100)


def test_dense_codecs_are_not_fusable() -> None:
    codec = create_codec("dense-f32", {})
    assert not codec.fusable and codec.sparse(b"", 1) is None
    with pytest.raises(NotImplementedError):
        codec.check(b"", 1)
