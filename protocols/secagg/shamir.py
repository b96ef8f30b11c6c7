"""Shamir secret sharing of seeds and keys over GF(2**521 - 1)."""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: The Mersenne prime ``2**521 - 1``: one field element holds a secret of up to 65 bytes.
PRIME = (1 << 521) - 1
_MAX_SECRET_BYTES = 65

# --------------------------------------------------------------------------------------------
# Shamir secret sharing over GF(2**521 - 1)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """Point ``(x, y)`` of a degree ``t - 1`` polynomial whose value at 0 encodes the secret."""

    x: int
    y: int
    t: int
    length: int


def split(
    secret: bytes,
    n: int,
    t: int,
    rng: random.Random | None = None,
    *,
    xs: Sequence[int] | None = None,
) -> list[Share]:
    """Split ``secret`` (1..65 bytes) into ``n`` shares, any ``t`` of which reconstruct it.

    The x-coordinates are ``1..n`` or ``xs`` (distinct, in ``[1, PRIME)``; the protocol uses the
    holders' client ids). Coefficients come from ``rng``, by default the operating system's CSPRNG;
    a seeded ``random.Random`` is for reproducible tests and simulation only.
    """
    if not 1 <= len(secret) <= _MAX_SECRET_BYTES:
        raise ValueError(f"secrets must have 1..{_MAX_SECRET_BYTES} bytes, got {len(secret)}")
    points = list(range(1, n + 1)) if xs is None else list(xs)
    if len(points) != n:
        raise ValueError(f"xs has {len(points)} coordinates for n={n} shares")
    if not 1 <= t <= n:
        raise ValueError(f"the threshold must satisfy 1 <= t <= n, got t={t}, n={n}")
    if len(set(points)) != n or not all(0 < x < PRIME for x in points):
        raise ValueError("x-coordinates must be distinct and in [1, PRIME)")
    draw = rng if rng is not None else secrets.SystemRandom()
    coefficients = [int.from_bytes(secret, "big")] + [draw.randrange(PRIME) for _ in range(t - 1)]
    shares = []
    for x in points:
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append(Share(x=x, y=y, t=t, length=len(secret)))
    return shares


def _interpolate(points: Sequence[tuple[int, int]], at: int) -> int:
    """The value at ``at`` of the polynomial through ``points``: Lagrange, in O(t) big-field
    multiplications plus one inversion (numerators from prefix and suffix products,
    denominators as exact integer products of coordinate differences, inverted together with
    Montgomery's trick). Unmasking reconstructs hundreds of secrets, and the naive form (two
    field multiplications per pair and one inversion per point) dominated a round's server
    time."""
    xs = [x for x, _ in points]
    t = len(xs)
    diffs = [(at - x) % PRIME for x in xs]
    prefix = [1] * (t + 1)
    for i, d in enumerate(diffs):
        prefix[i + 1] = prefix[i] * d % PRIME
    suffix = [1] * (t + 1)
    for i in range(t - 1, -1, -1):
        suffix[i] = suffix[i + 1] * diffs[i] % PRIME
    dens = _denominators(xs)
    running = [1] * (t + 1)  # Montgomery's batch inversion
    for i, d in enumerate(dens):
        running[i + 1] = running[i] * d % PRIME
    inv = pow(running[t], -1, PRIME)
    total = 0
    for i in range(t - 1, -1, -1):
        inv_i = inv * running[i] % PRIME
        inv = inv * dens[i] % PRIME
        total += points[i][1] * (prefix[i] * suffix[i + 1] % PRIME) % PRIME * inv_i
    return total % PRIME


#: :func:`_denominators` multiplies this many coordinate differences in int64 at a time: with
#: every |x| below ``2**_SMALL_X_BITS`` a difference has at most 12 bits, so 5 of them fit.
_SMALL_X_BITS, _GROUP = 11, 5


def _denominators(xs: Sequence[int]) -> list[int]:
    """``prod_{j != i} (x_i - x_j) mod PRIME`` for every ``i``.

    The protocol's coordinates are client indices (small), so the t x t differences are
    multiplied in int64 groups of :data:`_GROUP` with NumPy and only the groups' products in
    Python integers: reconstructing a secret from ~100 shares was 3 ms of pure-Python
    products, most of a large round's unmasking. Larger coordinates take the plain loop."""
    t = len(xs)
    if t > 1 and max(abs(x) for x in xs) < (1 << _SMALL_X_BITS):
        x = np.asarray(xs, dtype=np.int64)
        diffs = x[:, None] - x[None, :]
        np.fill_diagonal(diffs, 1)
        width = -(-t // _GROUP) * _GROUP
        padded = np.ones((t, width), dtype=np.int64)
        padded[:, :t] = diffs
        groups = padded.reshape(t, -1, _GROUP).prod(axis=2)  # exact: |product| < 2**60
        return [math.prod(row) % PRIME for row in groups.tolist()]
    dens = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if j != i:
                d *= xi - xj
        dens.append(d % PRIME)
    return dens


def combine(shares: Sequence[Share]) -> bytes:
    """Reconstruct the secret from at least ``t`` shares by Lagrange interpolation at 0.

    Refuses (``ValueError``) fewer than ``t`` shares, shares of different sharings (``t`` or
    ``length`` differ), duplicate or out-of-field coordinates, and extra shares that do not lie on
    the polynomial the first ``t`` define (so a wrong share is detected whenever there is one more
    share than the threshold).
    """
    if not shares:
        raise ValueError("no shares")
    t, length = shares[0].t, shares[0].length
    if any(s.t != t or s.length != length for s in shares):
        raise ValueError("shares come from different sharings (t or length differ)")
    if not 1 <= length <= _MAX_SECRET_BYTES or t < 1:
        raise ValueError(f"malformed share header: t={t}, length={length}")
    if len(shares) < t:
        raise ValueError(f"{len(shares)} shares are fewer than the threshold {t}")
    if len({s.x for s in shares}) != len(shares):
        raise ValueError("duplicate x-coordinates")
    if not all(0 < s.x < PRIME and 0 <= s.y < PRIME for s in shares):
        raise ValueError("share coordinates outside the field")
    basis = [(s.x, s.y) for s in shares[:t]]
    for extra in shares[t:]:
        if _interpolate(basis, extra.x) != extra.y:
            raise ValueError(f"share at x={extra.x} is inconsistent with the others")
    value = _interpolate(basis, 0)
    if value >> (8 * length):
        raise ValueError("the reconstructed value does not fit the secret length: bad shares")
    return value.to_bytes(length, "big")
