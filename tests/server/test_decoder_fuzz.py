"""Fuzzing every codec's decoder as the server runs it (``Decoder.decode``).

Random bytes and valid payloads with one byte changed either decode to a finite vector of the
model's length or are refused with a ServiceError (INVALID_ARGUMENT or FAILED_PRECONDITION);
no other exception escapes and nothing non-finite comes out. ``pytest -m fuzz`` runs 10,000
cases per codec.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmura.protocols import TaskSettings, available_codecs, create_codec
from murmura.protocols.codecs.partial import encode_partial
from murmura.server.decoding import Decoder
from murmura.server.errors import ServiceError

SIZE = 64
CODECS = [c for c in available_codecs() if c != "partial"] + ["partial"]
BUDGETS = [pytest.param(60, id="quick"),
           pytest.param(10_000, id="10k", marks=[pytest.mark.fuzz, pytest.mark.slow])]


def valid_payload(codec: str) -> bytes:
    """One honest payload for ``codec`` (a seed payload of a few zeroth-order steps)."""
    update = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
    if codec == "partial":
        return encode_partial(weight=3.0, count=2, sum_f32=update)
    c = create_codec(codec, {})
    enc = c.encoder(SIZE, seed=1)
    if codec == "seed":
        theta = torch.zeros(SIZE)
        for _ in range(3):
            enc.step(theta, seed=enc.next_seed(), g=0.5, lr=1e-2)
        return enc.encode(np.zeros(SIZE, np.float32))
    return enc.encode(update)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("codec", CODECS)
def test_decoders_refuse_garbage_with_a_service_error(codec: str, budget: int) -> None:
    settings_ = TaskSettings(trainer="zo", codec="seed") if codec == "seed" else TaskSettings()
    decoder = Decoder(SIZE, settings_)
    reference = np.zeros(SIZE, np.float32)
    good = valid_payload(codec)
    assert decoder.decode(codec, good, reference=reference).count >= 1  # the honest one decodes

    def mutated(args: tuple[int, int]) -> bytes:
        where, what = args
        buf = bytearray(good)
        buf[where % len(buf)] = what
        return bytes(buf)

    payloads = st.one_of(st.binary(max_size=4 * SIZE + 64),
                         st.tuples(st.integers(min_value=0), st.integers(0, 255)).map(mutated),
                         st.integers(0, len(good)).map(lambda n: good[:n]),
                         st.binary(max_size=16).map(lambda extra: good + extra))

    @settings(max_examples=budget, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(payloads)
    def run(payload: bytes) -> None:
        try:
            decoded = decoder.decode(codec, payload, reference=reference)
        except ServiceError as exc:
            assert exc.status in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
            assert len(exc.message) < 400
            return
        if decoded.values is not None:
            assert decoded.values.shape == (SIZE,) and np.isfinite(decoded.values).all()
            assert decoded.max_abs == pytest.approx(float(np.abs(decoded.values).max()))
    run()
