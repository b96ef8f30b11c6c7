"""Field limits, quoting and rate limits: pure checks with small inputs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from murmura.protocols import DeviceProfile, UpdateHeader
from murmura.protocols.errors import QUOTE, quote
from murmura.server.errors import InvalidArgument
from murmura.server.limits import (
    MAX_METRICS,
    MAX_NUM_EXAMPLES,
    check_header,
    check_number,
    check_profile,
    check_text,
)
from murmura.server.ratelimit import RateLimiter


def header(**kw) -> UpdateHeader:
    base = dict(session="s" * 22, update_id="u1", base_version=0, num_examples=5,
                codec="dense-f32", payload_bytes=16, spec_fingerprint="0123456789abcdef")
    base.update(kw)
    return UpdateHeader(**base)


@given(st.text(max_size=300))
def test_a_quote_never_echoes_more_than_a_few_dozen_characters(text: str) -> None:
    quoted = quote(text)
    assert len(quoted) <= 4 * QUOTE + 40  # repr may escape each kept character
    if len(text) > QUOTE:
        assert f"({len(text)} characters)" in quoted


def test_escapes_do_not_multiply_a_quote() -> None:
    # hypothesis found it: characters beyond the BMP repr as 10 characters each
    text = "0" * 12 + "\x1f" * 10 + "\U00011daa" * 10 + "0"
    quoted = quote(text)
    assert len(quoted) <= 4 * QUOTE + 40 and f"({len(text)} characters)" in quoted
    assert quoted.startswith("'000000000000")
    assert quote("\U0001f600" * 3) == repr("\U0001f600" * 3)  # short enough: all of it


def test_refusal_messages_stay_short_for_huge_inputs() -> None:
    huge = "x" * (1 << 20)
    for check in (lambda: check_text("codec", huge, 64),
                  lambda: check_header(header(codec=huge)),
                  lambda: check_header(header(metrics={huge: 1.0})),
                  lambda: check_profile(DeviceProfile(extra={"k": huge}))):
        with pytest.raises(InvalidArgument) as err:
            check()
        assert len(err.value.message) < 200


@pytest.mark.parametrize("bad", ["", "a\nb", "tab\there", "\x00", "\x1b[31mred"])
def test_text_with_control_characters_or_empty_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_text("update_id", bad, 128)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(value: float) -> None:
    with pytest.raises(InvalidArgument, match="finite"):
        check_number("wait_s", value)


@pytest.mark.parametrize("field,value,message", [
    ("num_examples", 0, "num_examples"),
    ("num_examples", MAX_NUM_EXAMPLES + 1, "num_examples"),
    ("spec_fingerprint", "", "spec_fingerprint is missing"),
    ("update_id", "id\nwith newline", "control"),
    ("metrics", {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}, "metrics"),
    ("metrics", {"loss": math.nan}, "finite"),
    ("round", -1, "round"),
    ("base_version", -1, "base version"),
])
def test_header_fields_out_of_bounds_are_refused(field: str, value: object,
                                                 message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_header(header(**{field: value}))


def test_a_sane_header_and_profile_pass() -> None:
    assert check_header(header(metrics={"loss": 0.3, "accuracy": 0.9})).update_id == "u1"
    profile = DeviceProfile(device="cuda", device_name="NVIDIA H100", memory_bytes=80 << 30,
                            steps_per_s=12.5, cpu_count=16, extra={"driver": "560"})
    assert check_profile(profile) is profile


@pytest.mark.parametrize("profile", [
    DeviceProfile(extra={f"k{i}": "v" for i in range(17)}),
    DeviceProfile(device_name="n" * 257),
    DeviceProfile(steps_per_s=math.nan),
    DeviceProfile(memory_bytes=-1),
])
def test_oversized_or_insane_profiles_are_refused(profile: DeviceProfile) -> None:
    with pytest.raises(InvalidArgument):
        check_profile(profile)


def test_a_bucket_allows_its_burst_then_paces_at_its_rate() -> None:
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.allow("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.allow("a", 0.0) == pytest.approx(0.5)  # one token takes 1/rate seconds
    assert limiter.allow("b", 0.0) == 0.0                 # other identities are unaffected
    assert limiter.allow("a", 1.0) == 0.0                 # refilled meanwhile


def test_a_zero_rate_turns_the_limiter_off_and_keys_are_bounded() -> None:
    assert all(RateLimiter(0, 1).allow("a", 0.0) == 0.0 for _ in range(100))
    limiter = RateLimiter(1.0, 1, max_keys=10)
    for i in range(100):
        limiter.allow(f"id-{i}", float(i))
    assert len(limiter) == 10


@given(st.lists(st.floats(min_value=0, max_value=100), min_size=1, max_size=50))
def test_a_bucket_never_grants_more_than_burst_plus_rate_times_elapsed(times) -> None:
    limiter = RateLimiter(rate=1.0, burst=5)
    times = sorted(times)
    granted = sum(limiter.allow("a", t) == 0.0 for t in times)
    assert granted <= 5 + (times[-1] - times[0]) * 1.0 + 1e-9
