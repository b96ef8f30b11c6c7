"""Bounds on everything a client sends, and refusal messages that never echo much of it.

Every string, map and number that arrives in a request is checked here before the core keeps or
uses it, so that a hostile client can neither grow the server's memory (a 256 KiB device profile
per session, a metrics map of any size), nor poison its logs and replies (control characters,
a 1 MiB codec name echoed into a gRPC status), nor slip a NaN past a comparison (``wait_s = NaN``
used to skip the 30 s cap, because every comparison with NaN is false).

The limits are generous for honest clients: ids and names are short words, a profile says a few
things about a device, an update reports a handful of training metrics.
"""

from __future__ import annotations

import math

from murmura.protocols import DeviceProfile, UpdateHeader
from murmura.protocols.errors import quote
from murmura.server.errors import InvalidArgument

MAX_ID = 128              # client ids, update ids
MAX_SESSION = 64          # sessions are 22 characters; anything longer is not one of ours
MAX_TOKEN = 256
#: Metrics named so are a client's evaluation report (server/client_eval.py): checked there,
#: and a malformed report is dropped while its update is taken, so the header check skips them.
EVAL_PREFIX = "eval_"
MAX_NAME = 64             # codec names, metric names, profile extra keys
MAX_TEXT = 256            # device names, profile extra values, leave reasons
MAX_METRICS = 32
MAX_PROFILE_EXTRA = 16
MAX_FINGERPRINT = 128
#: Far above any real data set on one client (or a leaf's sum of them), and small enough that
#: weight times a bounded value stays far from float overflow (see core's fold bound).
MAX_NUM_EXAMPLES = 1 << 40
def check_text(what: str, value: str, limit: int, *, allow_empty: bool = False) -> str:
    """Refuse a string that is empty (unless allowed), too long, or holds control characters."""
    if not value:
        if allow_empty:
            return value
        raise InvalidArgument(f"{what} is empty")
    if len(value) > limit:
        raise InvalidArgument(f"{what} has {len(value)} characters; at most {limit} are allowed")
    if not value.isprintable():
        raise InvalidArgument(f"{what} {quote(value)} holds control or non-printable characters")
    return value


def check_number(what: str, value: float, *, low: float = -math.inf,
                 high: float = math.inf) -> float:
    """Refuse NaN, infinities, and values outside ``[low, high]``."""
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number, got {value}")
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must lie in [{low:g}, {high:g}], got {value:g}")
    return value


def check_session(session: str) -> str:
    """A session string of a plausible size (the lookup itself says whether it is known)."""
    if len(session) > MAX_SESSION:
        raise InvalidArgument(f"session has {len(session)} characters; sessions have at most "
                              f"{MAX_SESSION}")
    return session


def check_profile(profile: DeviceProfile) -> DeviceProfile:
    """A device profile small and sane enough to keep for the session's lifetime."""
    check_text("profile.device", profile.device, MAX_NAME, allow_empty=True)
    check_text("profile.device_name", profile.device_name, MAX_TEXT, allow_empty=True)
    check_number("profile.memory_bytes", profile.memory_bytes, low=0)
    check_number("profile.steps_per_s", profile.steps_per_s, low=0)
    check_number("profile.cpu_count", profile.cpu_count, low=0, high=1 << 20)
    if len(profile.extra) > MAX_PROFILE_EXTRA:
        raise InvalidArgument(f"profile.extra has {len(profile.extra)} entries; at most "
                              f"{MAX_PROFILE_EXTRA} are allowed")
    for key, value in profile.extra.items():
        check_text("a profile.extra key", key, MAX_NAME)
        check_text(f"profile.extra[{quote(key)}]", value, MAX_TEXT, allow_empty=True)
    return profile


def check_header(header: UpdateHeader) -> UpdateHeader:
    """Field-level checks of an update header; the core checks it against its state."""
    check_session(header.session)
    check_text("update_id", header.update_id, MAX_ID)
    check_text("codec", header.codec, MAX_NAME)
    if not header.spec_fingerprint:
        raise InvalidArgument("spec_fingerprint is missing: an update names the model spec it "
                              "was trained for (ModelSpec.fingerprint())")
    check_text("spec_fingerprint", header.spec_fingerprint, MAX_FINGERPRINT)
    check_number("num_examples", header.num_examples, low=1, high=MAX_NUM_EXAMPLES)
    if header.payload_bytes < 0:
        raise InvalidArgument(f"payload_bytes must be >= 0, got {header.payload_bytes}")
    if header.base_version < 0:
        raise InvalidArgument(f"base version must be >= 0, got {header.base_version}")
    if header.round < 0:
        raise InvalidArgument(f"round must be >= 0, got {header.round}")
    if len(header.metrics) > MAX_METRICS:
        raise InvalidArgument(f"an update reports {len(header.metrics)} metrics; at most "
                              f"{MAX_METRICS} are allowed")
    for name, value in header.metrics.items():
        check_text("a metric name", name, MAX_NAME)
        if name.startswith(EVAL_PREFIX):
            continue  # a malformed evaluation report is ignored, not refused (client_eval.py)
        try:
            finite = math.isfinite(value)
        except TypeError:
            raise InvalidArgument(f"metric {quote(name)} must be a number, got "
                                  f"{type(value).__name__}") from None
        if not finite:  # the message is built only for a refusal
            check_number(f"metric {quote(name)}", value)
    return header


__all__ = ["EVAL_PREFIX", "MAX_ID", "MAX_NUM_EXAMPLES", "check_header", "check_number",
           "check_profile", "check_session", "check_text", "quote"]
