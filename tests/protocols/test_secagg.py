"""SecAgg+ core: fixed-point encoding, key agreement and PRG, Shamir, neighbour graph, rounds."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from murmura.protocols import secagg
from murmura.protocols.secagg import (
    PRIME,
    FieldSpec,
    Round,
    RoundAbandoned,
    Share,
    combine,
    default_degree,
    dequantise,
    expand_mask,
    mask,
    neighbours,
    pair_seed,
    quantise,
    split,
    threshold,
    unmask,
)
from murmura.protocols.secagg.shamir import _interpolate

FAST = settings(max_examples=40, deadline=None)


def _ring_inputs(n: int, length: int, bits: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.integers(0, 1 << bits, size=length, dtype=np.uint64) for i in range(1, n + 1)}


def _ring_sum(inputs: dict[int, np.ndarray], clients: list[int], bits: int) -> np.ndarray:
    total = np.zeros_like(next(iter(inputs.values())))
    for i in clients:
        total = total + inputs[i]
    return total & np.uint64((1 << bits) - 1)


# ------------------------------------------------------------------ fixed-point encoding


@FAST
@given(
    n=st.integers(1, 6),
    n_max=st.integers(6, 1000),
    bits=st.sampled_from([16, 32, 48, 64]),
    clip=st.floats(0.01, 100.0),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantised_sum_is_within_n_steps_of_the_float_sum(
    n: int, n_max: int, bits: int, clip: float, stochastic: bool, seed: int
) -> None:
    # Prepare
    spec = FieldSpec(bits=bits, clip=clip, n_max=n_max)
    rng = np.random.default_rng(seed)
    updates = [rng.uniform(-clip, clip, size=17).astype(np.float32) for _ in range(n)]
    updates = [np.clip(u, -clip, clip) for u in updates]
    # Execute
    total = np.zeros(17, dtype=np.uint64)
    for u in updates:
        q = quantise(u, clip=clip, bits=bits, n_max=n_max, rng=rng if stochastic else None)
        total = (total + q) & np.uint64(spec.modulus - 1)
    decoded = dequantise(total, count=n, clip=clip, bits=bits, n_max=n_max)
    # Assert: n steps of rounding, plus the float32 rounding of the decoded result
    exact = np.sum(np.stack(updates).astype(np.float64), axis=0)
    tolerance = n * spec.step + (np.abs(exact) + n * clip) * 2.0**-23
    assert np.all(np.abs(decoded.astype(np.float64) - exact) <= tolerance)


def test_values_beyond_the_clip_are_clipped_and_the_worst_case_sum_does_not_wrap() -> None:
    spec = FieldSpec(bits=16, clip=1.0, n_max=5)
    q = quantise(np.array([50.0, -50.0, 1.0], dtype=np.float32), clip=1.0, bits=16, n_max=5)
    total = (q * np.uint64(5)) & np.uint64(spec.modulus - 1)  # five clients all at the clip
    decoded = dequantise(total, count=5, clip=1.0, bits=16, n_max=5)
    np.testing.assert_allclose(decoded, [5.0, -5.0, 5.0])
    assert 2 * spec.n_max * spec.levels < spec.modulus


def test_parameters_that_could_overflow_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        quantise(np.zeros(3), clip=1.0, bits=8, n_max=200)
    with pytest.raises(ValueError):
        FieldSpec(bits=65, clip=1.0, n_max=2)
    with pytest.raises(ValueError):
        FieldSpec(bits=32, clip=0.0, n_max=2)


def test_non_finite_and_non_flat_updates_are_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        quantise(np.array([np.nan]), clip=1.0, bits=32, n_max=4)
    with pytest.raises(ValueError, match="flat"):
        quantise(np.zeros((2, 2)), clip=1.0, bits=32, n_max=4)


def test_a_sum_outside_the_possible_range_is_refused() -> None:
    spec = FieldSpec(bits=16, clip=1.0, n_max=4)
    beyond = np.array([2 * spec.levels + 1], dtype=np.uint64)
    with pytest.raises(ValueError, match="out of range"):
        dequantise(beyond, count=2, clip=1.0, bits=16, n_max=4)
    with pytest.raises(ValueError, match="count"):
        dequantise(np.zeros(1, dtype=np.uint64), count=5, clip=1.0, bits=16, n_max=4)


def test_stochastic_rounding_is_unbiased_and_reproducible() -> None:
    update = np.full(20000, 0.3, dtype=np.float64)
    a = quantise(update, clip=1.0, bits=8, n_max=1, rng=np.random.default_rng(1))
    b = quantise(update, clip=1.0, bits=8, n_max=1, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(a, b)
    mean = dequantise(a, count=1, clip=1.0, bits=8, n_max=1).astype(np.float64).mean()
    nearest = quantise(update, clip=1.0, bits=8, n_max=1)
    biased = dequantise(nearest, count=1, clip=1.0, bits=8, n_max=1).astype(np.float64).mean()
    assert abs(mean - 0.3) < 3e-4  # the standard error is about 3e-5
    assert abs(biased - 0.3) > 5e-4  # round-to-nearest sits at 38/127 = 0.2992


# ------------------------------------------------------------------ key agreement and PRG


def test_pair_seed_is_symmetric_and_bound_to_round_and_pair() -> None:
    a, b, c = (X25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in (1, 2, 3))
    pub = {k: v.public_key().public_bytes_raw() for k, v in {"a": a, "b": b, "c": c}.items()}
    ab = pair_seed(a, pub["b"], round_id=7, me=1, peer=2)
    assert ab == pair_seed(b, pub["a"], round_id=7, me=2, peer=1)
    assert len(ab) == 32
    assert ab != pair_seed(a, pub["b"], round_id=8, me=1, peer=2)
    assert ab != pair_seed(a, pub["b"], round_id=7, me=1, peer=3)
    assert ab != pair_seed(a, pub["c"], round_id=7, me=1, peer=2)
    with pytest.raises(ValueError):
        pair_seed(a, pub["b"], round_id=7, me=1, peer=1)


def test_expand_mask_is_deterministic_little_endian_chacha20() -> None:
    seed = bytes(range(32))
    first = expand_mask(seed, 10, bits=32, round_id=3)
    np.testing.assert_array_equal(first, expand_mask(seed, 10, bits=32, round_id=3))
    # a prefix of a longer stream, and separated by purpose and round
    np.testing.assert_array_equal(first, expand_mask(seed, 25, bits=32, round_id=3)[:10])
    assert not np.array_equal(first, expand_mask(seed, 10, bits=32, round_id=3, purpose="self"))
    assert not np.array_equal(first, expand_mask(seed, 10, bits=32, round_id=4))
    wide = expand_mask(seed, 10, bits=64, round_id=3)
    narrow = expand_mask(seed, 10, bits=20, round_id=3)
    assert wide.dtype == np.uint64 and int(narrow.max()) < 1 << 20
    with pytest.raises(ValueError):
        expand_mask(seed[:16], 4, bits=32, round_id=3)


# ------------------------------------------------------------------ Shamir


@FAST
@given(
    secret=st.binary(min_size=1, max_size=65),
    n=st.integers(1, 9),
    data=st.data(),
)
def test_any_t_of_n_shares_reconstruct_and_t_minus_one_do_not(
    secret: bytes, n: int, data: st.DataObject
) -> None:
    t = data.draw(st.integers(1, n))
    shares = split(secret, n, t, random.Random(data.draw(st.integers(0, 2**32))))
    subset = data.draw(st.permutations(shares))[: data.draw(st.integers(t, n))]
    assert combine(subset) == secret
    if t > 1:
        # Interpolating only t - 1 points gives another value (with overwhelming probability).
        fewer = [replace(s, t=t - 1) for s in shares[: t - 1]]
        try:
            assert combine(fewer) != secret
        except ValueError:  # the wrong value may not even fit the secret length
            pass


@FAST
@given(secret=st.binary(min_size=32, max_size=32), other=st.binary(min_size=32, max_size=32))
def test_t_minus_one_shares_are_consistent_with_every_secret(secret: bytes, other: bytes) -> None:
    # Perfect secrecy: through any t - 1 shares and ANY candidate secret passes exactly one
    # polynomial of degree t - 1, so the shares say nothing about which secret was dealt.
    s1, s2 = split(secret, 5, 3, random.Random(0))[:2]
    points = [(0, int.from_bytes(other, "big")), (s1.x, s1.y), (s2.x, s2.y)]
    forged = Share(x=3, y=_interpolate(points, 3), t=3, length=32)
    assert combine([s1, s2, forged]) == other


def test_malformed_shares_are_refused() -> None:
    shares = split(b"k" * 32, 5, 3, random.Random(0))
    with pytest.raises(ValueError, match="fewer than the threshold"):
        combine(shares[:2])
    with pytest.raises(ValueError, match="duplicate"):
        combine([shares[0], shares[0], shares[1]])
    with pytest.raises(ValueError, match="outside the field"):
        combine([shares[0], shares[1], replace(shares[2], y=PRIME)])
    with pytest.raises(ValueError, match="outside the field"):
        combine([shares[0], shares[1], replace(shares[2], x=0)])
    with pytest.raises(ValueError, match="different sharings"):
        combine([shares[0], shares[1], replace(shares[2], length=31)])
    with pytest.raises(ValueError, match="inconsistent"):
        combine(shares[:3] + [replace(shares[3], y=(shares[3].y + 1) % PRIME)])
    with pytest.raises(ValueError):
        split(b"", 3, 2)
    with pytest.raises(ValueError):
        split(b"x", 3, 4)
    with pytest.raises(ValueError):
        split(b"x", 2, 2, xs=[4, 4])


def test_split_uses_the_given_coordinates() -> None:
    shares = split(b"seed" * 8, 3, 2, random.Random(1), xs=[4, 9, 17])
    assert [s.x for s in shares] == [4, 9, 17]
    assert combine([shares[2], shares[0]]) == b"seed" * 8


# ------------------------------------------------------------------ neighbour graph


@pytest.mark.parametrize(("n", "k"), [(2, 1), (5, 4), (10, 3), (11, 4), (40, 9), (7, 50)])
def test_graph_is_symmetric_regular_and_deterministic(n: int, k: int) -> None:
    graph = neighbours(n, k, seed=42)
    assert sorted(graph) == list(range(1, n + 1))
    for i, adjacent in graph.items():
        assert i not in adjacent
        assert len(adjacent) == min(k, n - 1)
        assert all(i in graph[j] for j in adjacent)
    assert graph == neighbours(n, k, seed=42)
    if k < n - 1:
        assert graph != neighbours(n, k, seed=43)


def test_graph_without_a_regular_solution_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        neighbours(9, 3, seed=0)


def test_threshold_is_a_strict_majority_of_the_neighbourhood() -> None:
    assert [threshold(k) for k in (1, 2, 3, 4, 9, 10)] == [1, 2, 2, 3, 5, 6]
    for k in range(1, 30):
        assert k / 2 < threshold(k) <= k


def test_default_degree_grows_logarithmically_and_is_feasible() -> None:
    small, large = default_degree(100, 0.1), default_degree(10_000, 0.1)
    assert small < 100 and large < 3 * small
    for n in (3, 9, 50, 101):
        k = default_degree(n, 0.2)
        assert 1 <= k <= n - 1 and (n * k) % 2 == 0
    assert default_degree(10, 0.45) == 9  # too much dropout for a sparse graph: complete graph
    with pytest.raises(ValueError):
        default_degree(10, 0.5)


# ------------------------------------------------------------------ masking and rounds


def test_mask_and_unmask_cancel_without_a_round() -> None:
    graph = {1: [2, 3], 2: [1, 3], 3: [1, 2]}
    seeds = {(i, j): bytes([min(i, j), max(i, j)]) * 16 for i in graph for j in graph[i]}
    selfs = {i: bytes([9, i]) * 16 for i in graph}
    x = _ring_inputs(3, 6, 32, seed=0)
    ys = [
        mask(
            i,
            x[i],
            self_seed=selfs[i],
            pair_seeds={j: seeds[(i, j)] for j in graph[i]},
            round_id=1,
            bits=32,
        )
        for i in (1, 2)
    ]  # client 3 drops before its masked input
    out = unmask(
        (ys[0] + ys[1]) & np.uint64(2**32 - 1),
        graph=graph,
        included=[1, 2],
        dropped=[3],
        self_seeds={1: selfs[1], 2: selfs[2]},
        pair_seeds={(1, 3): seeds[(1, 3)], (2, 3): seeds[(2, 3)]},
        round_id=1,
        bits=32,
    )
    np.testing.assert_array_equal(out, _ring_sum(x, [1, 2], 32))
    with pytest.raises(ValueError, match="pair_seeds"):
        unmask(
            ys[0],
            graph=graph,
            included=[1, 2],
            dropped=[3],
            self_seeds={1: selfs[1], 2: selfs[2]},
            pair_seeds={},
            round_id=1,
            bits=32,
        )


def test_round_without_dropouts_gives_the_exact_sum() -> None:
    rnd = Round(12, round_id=5, bits=32, seed=1)
    x = _ring_inputs(12, 8, 32, seed=1)
    np.testing.assert_array_equal(rnd.run(x), _ring_sum(x, list(range(1, 13)), 32))


def test_round_with_float_updates_end_to_end() -> None:
    n, clip = 6, 0.5
    rng = np.random.default_rng(3)
    updates = {i: rng.normal(0, 0.2, size=9).astype(np.float32) for i in range(1, n + 1)}
    ints = {i: quantise(u, clip=clip, bits=32, n_max=n, rng=rng) for i, u in updates.items()}
    rnd = Round(n, round_id=1, bits=32, seed=3, degree=4)
    decoded = dequantise(rnd.run(ints), count=n, clip=clip, bits=32, n_max=n)
    exact = np.sum([np.clip(u, -clip, clip) for u in updates.values()], axis=0)
    step = FieldSpec(bits=32, clip=clip, n_max=n).step
    np.testing.assert_allclose(decoded, exact, atol=n * step + 1e-6)


def test_round_survives_dropouts_up_to_the_threshold() -> None:
    # Prepare: 12 clients, degree 6, threshold 4: every neighbourhood may lose 2 of its 6.
    n = 12
    rnd = Round(n, round_id=2, bits=64, degree=6, seed=7)
    x = _ring_inputs(n, 5, 64, seed=2)
    gone: list[int] = []
    for c in range(1, n + 1):  # greedily drop as many as the threshold allows
        if all(len(rnd.graph[i] & {*gone, c}) <= 6 - rnd.t for i in rnd.graph):
            gone.append(c)
    before, after = gone[::2], gone[1::2]
    assert len(before) >= 2 and len(after) >= 1
    # Execute
    out = rnd.run(x, drop_before_input=before, drop_before_unmask=after)
    # Assert: the early dropouts are out of the sum, the late ones (masked input sent) are in it
    np.testing.assert_array_equal(out, _ring_sum(x, [i for i in x if i not in before], 64))


@pytest.mark.parametrize("stage", ["before_input", "before_unmask"])
def test_round_with_too_many_dropouts_is_abandoned(stage: str) -> None:
    rnd = Round(10, round_id=2, bits=32, degree=4, seed=8)
    x = _ring_inputs(10, 5, 32, seed=3)
    victim = 1
    gone = sorted(rnd.graph[victim])[:2]  # 2 of 4 neighbours leave: 2 < threshold 3 remain
    kwargs = (
        {"drop_before_input": gone} if stage == "before_input" else {"drop_before_unmask": gone}
    )
    with pytest.raises(RoundAbandoned):
        rnd.run(x, **kwargs)


def test_masked_inputs_differ_from_inputs_and_look_uniform() -> None:
    rnd = Round(4, round_id=9, bits=32, degree=3, seed=4)
    zeros = np.zeros(4096, dtype=np.uint64)
    y = rnd.masked_input(1, zeros)
    assert np.count_nonzero(y == zeros) < 5
    byte_counts = np.bincount(y.astype("<u4").view(np.uint8), minlength=256)
    expected = 4096 * 4 / 256
    chi2 = float(((byte_counts - expected) ** 2 / expected).sum())
    assert chi2 < 400  # 255 degrees of freedom: mean 255, sd about 23
    assert abs(y.astype(np.float64).mean() / 2**32 - 0.5) < 0.02


def test_a_malformed_share_is_dropped_when_enough_remain() -> None:
    rnd = Round(8, round_id=3, bits=32, degree=7, seed=5)  # complete graph, threshold 4
    x = _ring_inputs(8, 4, 32, seed=4)

    def tamper(holder: int, owner: int, kind: str, share: Share) -> Share:
        if holder == 2 and owner == 1:
            return replace(share, x=share.x + 1)  # wrong coordinate
        if holder == 3 and owner == 1:
            return replace(share, length=16)  # wrong length
        if holder == 4 and owner == 1:
            return replace(share, y=(share.y + 1) % PRIME)  # well-formed but wrong value
        return share

    np.testing.assert_array_equal(rnd.run(x, tamper=tamper), _ring_sum(x, list(range(1, 9)), 32))


def test_malformed_shares_abandon_the_round_when_too_few_remain() -> None:
    rnd = Round(6, round_id=3, bits=32, degree=4, seed=6)  # threshold 3 of 4
    x = _ring_inputs(6, 4, 32, seed=5)
    holders = sorted(rnd.graph[1])[:2]

    def tamper(holder: int, owner: int, kind: str, share: Share) -> Share:
        return replace(share, x=0) if owner == 1 and holder in holders else share

    with pytest.raises(RoundAbandoned):
        rnd.run(x, tamper=tamper)


def test_a_replayed_public_key_is_refused() -> None:
    rnd = Round(5, round_id=1, bits=32, degree=4, seed=2)
    rnd.public_keys[2] = rnd.public_keys[1]
    with pytest.raises(ValueError, match="same public key"):
        rnd.run(_ring_inputs(5, 3, 32, seed=0))


def test_a_client_refuses_to_reveal_both_secrets_of_one_client() -> None:
    rnd = Round(5, round_id=1, bits=32, degree=4, seed=2)
    with pytest.raises(ValueError, match="both"):
        rnd.clients[1].respond(included=[2, 3], dropped=[3])


def test_round_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="threshold"):
        Round(6, round_id=0, degree=4, t=2)
    assert secagg.Round(6, round_id=0, degree=4).t == 3


def test_unknown_dropouts_are_refused_and_unseeded_rounds_use_the_os_csprng() -> None:
    x = _ring_inputs(4, 3, 32, seed=9)
    with pytest.raises(ValueError, match="dropouts"):
        Round(4, round_id=0, degree=3, seed=1).run(x, drop_before_input=[7])
    np.testing.assert_array_equal(
        Round(4, round_id=0, degree=3).run(x), _ring_sum(x, [1, 2, 3, 4], 32)
    )


@pytest.mark.parametrize("t", [1, 2, 5, 6, 33, 104])
@pytest.mark.parametrize("span", [50, 2047, 2048, 10**12])
def test_interpolation_denominators_match_the_plain_products(t: int, span: int) -> None:
    """The int64-grouped products (small coordinates) and the plain loop (any coordinates)
    give the same Lagrange denominators, signs included."""
    from murmura.protocols.secagg import shamir

    rng = random.Random(t * 7919 + span)
    xs = rng.sample(range(1, span + 1), t) if span >= t else list(range(1, t + 1))
    want = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if j != i:
                d *= xi - xj
        want.append(d % shamir.PRIME)
    assert shamir._denominators(xs) == want


@pytest.mark.parametrize("bits", [16, 32, 40, 64])
def test_mask_streams_expand_what_expand_words_does_into_one_scratch(bits: int) -> None:
    from murmura.protocols.secagg.keys import MaskStreams, expand_words

    streams = MaskStreams(1001, bits=bits)
    seeds = [bytes([i]) * 32 for i in range(1, 4)]
    for round_id, purpose in ((0, "self"), (7, "pair")):
        for seed in seeds:
            got = streams.words(seed, round_id=round_id, purpose=purpose)
            want = expand_words(seed, 1001, bits=bits, round_id=round_id, purpose=purpose)
            assert got.dtype == want.dtype and np.array_equal(got, want)
    first = streams.words(seeds[0], round_id=1).copy()
    view = streams.words(seeds[0], round_id=1)
    streams.words(seeds[1], round_id=1)  # the next call reuses the scratch
    assert not np.array_equal(view, first) and np.shares_memory(view, streams.words(seeds[0],
                                                                                     round_id=1))
    with pytest.raises(ValueError, match="mask seed has 32 bytes"):
        streams.words(b"short", round_id=1)
    with pytest.raises(ValueError, match="purpose must be one of"):
        streams.words(seeds[0], round_id=1, purpose="other")
    with pytest.raises(ValueError, match="bits must be in"):
        MaskStreams(10, bits=65)
