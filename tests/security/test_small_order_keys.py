"""Ed25519 public keys that are refused: wrong length, non-canonical, off the curve, small order.

Under a small-order public key A (8A = identity) forgery is trivial with a cofactorless check
S*B == R + h*A such as OpenSSL's: with S = 0 and R = -h*A it holds, so R = identity works for
every message when A is the identity and, for the other seven, whenever h*A happens to be the
identity (one try in at most 8). So a node that joined with such a key could be impersonated
by anyone. These tests derive the eight small-order
points from the curve itself, with their own affine arithmetic (independent of the module's
extended-coordinate doubling), and check every encoding of them is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.gossip.errors import InvalidArgument, PermissionDenied
from murmura.gossip.identity import AddressBinding
from murmura.protocols.identity import (
    IdentityError,
    NodeKey,
    check_public_key,
    join_message,
    load_public_keys,
    parse_public_key,
    peer_message,
    verify,
)

# -- a reference Ed25519 in affine coordinates (slow and simple) ------------------------------

P = 2**255 - 19
D = -121665 * pow(121666, -1, P) % P
L = 2**252 + 27742317777372353535851937790883648493  # the prime order of the base point
IDENTITY = (0, 1)


def inv(a: int) -> int:
    return pow(a, -1, P)


def add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Twisted Edwards addition for -x^2 + y^2 = 1 + d x^2 y^2 (complete: no special cases)."""
    (x1, y1), (x2, y2) = a, b
    t = D * x1 * x2 * y1 * y2 % P
    return ((x1 * y2 + x2 * y1) * inv(1 + t) % P, (y1 * y2 + x1 * x2) * inv(1 - t) % P)


def mul(k: int, point: tuple[int, int]) -> tuple[int, int]:
    out = IDENTITY
    while k:
        if k & 1:
            out = add(out, point)
        point = add(point, point)
        k >>= 1
    return out


def on_curve(x: int, y: int) -> bool:
    return (-x * x + y * y - 1 - D * x * x * y * y) % P == 0


def x_for(y: int) -> int | None:
    """A square root x of (y^2 - 1) / (d y^2 + 1), or None when there is none."""
    x2 = (y * y - 1) * inv(D * y * y + 1) % P
    if x2 == 0:
        return 0
    if pow(x2, (P - 1) // 2, P) != 1:  # Euler's criterion: not a square
        return None
    x = pow(x2, (P + 3) // 8, P)  # p = 5 (mod 8): this or x * sqrt(-1) is a root
    if x * x % P != x2:
        x = x * pow(2, (P - 1) // 4, P) % P
    assert x * x % P == x2
    return x


def encode(point: tuple[int, int], *, y_offset: int = 0, flip_sign: bool = False) -> bytes:
    """RFC 8032's encoding (y little-endian, x's parity in the top bit); ``y_offset=P`` gives
    the non-canonical twin of a small y, ``flip_sign`` the other sign bit."""
    x, y = point
    y += y_offset
    assert y < 2**255
    sign = (x & 1) ^ flip_sign
    return (y | sign << 255).to_bytes(32, "little")


def reference_accepts(raw: bytes) -> bool:
    """RFC 8032 decoding, then "not of small order", the slow way."""
    n = int.from_bytes(raw, "little")
    y, sign = n & (2**255 - 1), n >> 255
    if y >= P:
        return False
    x = x_for(y)
    if x is None or (x == 0 and sign):
        return False
    if x & 1 != sign:
        x = P - x
    assert on_curve(x, y)
    return mul(8, (x, y)) != IDENTITY


def _torsion() -> list[tuple[int, int]]:
    """The eight points of order dividing 8: L times any curve point lies in that subgroup;
    take the first such multiple of order exactly 8 and its eight multiples."""
    y = 2
    while True:
        x = x_for(y)
        if x is not None:
            t = mul(L, (x, y))
            if mul(4, t) != IDENTITY:
                points = [mul(k, t) for k in range(8)]
                assert mul(8, t) == IDENTITY and len(set(points)) == 8
                return points
        y += 1


TORSION = _torsion()
SMALL_ORDER = [encode(p) for p in TORSION]

# The same eight canonical encodings as published in blocklists of small-order Ed25519 points
# (libsodium, Monocypher): order 1 (y = 1), order 2 (y = p - 1), order 4 (y = 0, both signs)
# and order 8 (two y values, both signs). Listed to cross-check the derivation above.
KNOWN_SMALL_ORDER = {
    "0100000000000000000000000000000000000000000000000000000000000000",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0000000000000000000000000000000000000000000000000000000000000080",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
}


def every_encoding_of_the_small_order_points() -> list[bytes]:
    """Canonical, sign-flipped, and (where y + p < 2^255) y + p with either sign bit, without
    repeats (flipping the sign of an order-4 or order-8 point encodes its negation, another
    of the eight)."""
    out = []
    for point in TORSION:
        out += [encode(point), encode(point, flip_sign=True)]
        if point[1] + P < 2**255:
            out += [encode(point, y_offset=P), encode(point, y_offset=P, flip_sign=True)]
    return list(dict.fromkeys(out))


def test_the_derived_small_order_points_are_the_published_eight() -> None:
    assert {raw.hex() for raw in SMALL_ORDER} == KNOWN_SMALL_ORDER
    assert all(on_curve(*p) for p in TORSION)
    # 8 canonical; 2 with x = 0 and the sign bit set (y = 1, y = p - 1); and y = p, p + 1
    # (the twins of y = 0 and y = 1, the only small y among them) with either sign bit
    assert len(every_encoding_of_the_small_order_points()) == 8 + 2 + 4


@pytest.mark.parametrize("raw", SMALL_ORDER, ids=lambda raw: raw.hex()[:8])
def test_every_small_order_point_is_refused(raw: bytes) -> None:
    with pytest.raises(IdentityError, match="small order"):
        check_public_key(raw)


@pytest.mark.parametrize("raw", every_encoding_of_the_small_order_points(),
                         ids=lambda raw: raw.hex()[:8] + raw.hex()[-2:])
def test_every_encoding_of_a_small_order_point_is_refused(raw: bytes) -> None:
    with pytest.raises(IdentityError, match=r"^invalid Ed25519 public key: ") as info:
        check_public_key(raw)
    assert "\n" not in str(info.value)
    with pytest.raises(IdentityError):
        parse_public_key(raw.hex())
    # no signature of any of the eight torsion points as R, with S = 0, verifies under it
    for r in SMALL_ORDER:
        assert not verify(raw, r + bytes(32), b"any message")


def test_the_identity_point_forgery_does_not_verify() -> None:
    identity = encode(IDENTITY)
    assert identity == bytes([1]) + bytes(31)
    forged = identity + bytes(32)  # R = identity, S = 0: S*B == R + h*A for every message
    for message in (b"", b"push", join_message(b"n" * 32, "n-x", identity)):
        assert not verify(identity, forged, message)


@pytest.mark.parametrize("y", [P, P + 1, P + 2, P + 18, 2**255 - 1])
@pytest.mark.parametrize("sign", [0, 1])
def test_a_y_coordinate_at_or_above_p_is_refused(y: int, sign: int) -> None:
    raw = (y | sign << 255).to_bytes(32, "little")
    with pytest.raises(IdentityError, match="non-canonical"):
        check_public_key(raw)


def test_a_y_without_a_curve_point_is_refused() -> None:
    off = [y for y in range(2, 60) if x_for(y) is None][:5]
    assert off
    for y in off:
        for sign in (0, 1):
            with pytest.raises(IdentityError, match="not a point on the curve"):
                check_public_key((y | sign << 255).to_bytes(32, "little"))


def test_x_zero_with_the_sign_bit_set_is_refused() -> None:
    for y in (1, P - 1):  # the two points with x = 0
        with pytest.raises(IdentityError, match="sign bit"):
            check_public_key(encode((0, y), flip_sign=True))


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_a_key_of_the_wrong_length_is_refused(size: int) -> None:
    with pytest.raises(IdentityError, match=f"has {size} bytes"):
        check_public_key(bytes([9]) * size)
    assert not verify(bytes([9]) * size, bytes(64), b"m")


def test_real_keys_pass_and_still_verify() -> None:
    for _ in range(200):
        key = NodeKey.generate()
        assert check_public_key(key.public_bytes) == key.public_bytes
        assert parse_public_key(key.public_hex) == key.public_bytes
    assert verify(key.public_bytes, key.sign(b"m"), b"m")
    assert check_public_key(bytearray(key.public_bytes)) == key.public_bytes


def test_a_real_key_plus_a_torsion_point_is_not_small_order_and_passes() -> None:
    raw = NodeKey.from_seed("mixed").public_bytes
    n = int.from_bytes(raw, "little")
    y, sign = n & (2**255 - 1), n >> 255
    x = x_for(y)
    assert x is not None
    point = (x if x & 1 == sign else P - x, y)
    mixed = encode(add(point, TORSION[1]))
    assert reference_accepts(mixed)
    assert check_public_key(mixed) == mixed


def test_an_allow_list_with_a_small_order_key_is_refused_with_its_line(tmp_path) -> None:
    good = NodeKey.generate()
    (tmp_path / "allow.list").write_text(f"{good.public_hex}\n{SMALL_ORDER[0].hex()}  # id\n")
    with pytest.raises(IdentityError, match=r"allow\.list:2: invalid Ed25519 public key: a "
                                            r"point of small order"):
        load_public_keys(tmp_path / "allow.list")


def test_a_gossip_peer_with_a_small_order_key_is_refused_and_bound_to_nothing() -> None:
    binding = AddressBinding("me", is_alive=lambda peer_id, address: True)
    identity = SMALL_ORDER[0]
    forged = identity + bytes(32)
    message = peer_message("exchange", "victim", "10.0.0.1:5000", identity)
    with pytest.raises(PermissionDenied, match="does not verify"):
        binding.check("victim", "10.0.0.1:5000", public_key=identity, signature=forged,
                      message=message)
    assert binding.key_of("victim") is None and binding.address_of("victim") is None
    with pytest.raises(InvalidArgument):  # the wrong length is still its own refusal
        binding.check("victim", "10.0.0.1:5000", public_key=b"k", signature=forged,
                      message=message)


def test_the_server_refuses_a_join_with_a_small_order_key() -> None:
    import numpy as np

    from murmura.protocols import DeviceProfile, JoinProof, ModelSpec, TensorSpec
    from murmura.protocols.identity import client_id_for
    from murmura.server import AggregatorCore, ServerConfig
    from murmura.server.errors import ServiceError

    core = AggregatorCore(ServerConfig.from_flat(min_clients=1),
                          ModelSpec((TensorSpec("w", (2,)),)), np.zeros(2, np.float32))
    for raw in SMALL_ORDER:
        nonce, _ = core.challenge()
        proof = JoinProof(public_key=raw, nonce=nonce, signature=encode(IDENTITY) + bytes(32))
        with pytest.raises(ServiceError):  # refused whether by the key check or by verify()
            core.join(client_id_for(raw), DeviceProfile(), proof=proof)
    assert not core.sessions


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(min_size=32, max_size=32),
                 st.sampled_from(every_encoding_of_the_small_order_points()),
                 st.integers(0, 2**255 - 1).map(lambda y: y.to_bytes(32, "little")),
                 st.integers(P - 40, 2**256 - 1).map(lambda n: n.to_bytes(32, "little"))))
def test_check_public_key_agrees_with_the_reference(raw: bytes) -> None:
    accepted = reference_accepts(raw)
    if accepted:
        assert check_public_key(raw) == raw
    else:
        with pytest.raises(IdentityError):
            check_public_key(raw)
