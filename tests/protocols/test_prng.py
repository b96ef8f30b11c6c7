"""The counter-based Rademacher generator: three implementations agree, on any slicing or device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from murmura.protocols import prng

_M32 = 0xFFFFFFFF


def _mix_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _value_python(seed: int, i: int) -> float:
    """The spec of docs/seed-prng.md in plain Python integers: a third, independent version."""
    keys = prng.splitmix64(seed)
    word = _mix_python(_mix_python((i >> 5) ^ (keys & _M32)) ^ (keys >> 32))
    return -1.0 if (word >> (i & 31)) & 1 else 1.0


def _signs(values: torch.Tensor | np.ndarray) -> str:
    return "".join("+" if v > 0 else "-" for v in np.asarray(values).tolist())


SEEDS = [0, 1, 42, 2**32, 2**64 - 1]

# Test vectors, also printed in docs/seed-prng.md.
VECTORS = {
    0: (0xE220A8397B1DCDAF, [0x7F2DAC84, 0xDE8D8B7D, 0xF2EEB844, 0x243F59FC],
        "++-++++-++--+-+--+--+-++-------+"),
    1: (0x910A2DEC89025CC1, [0x60E1BB31, 0x6DB0FCC3, 0x4D389B49, 0xFA79C220],
        "-+++--++--+---+--++++---+++++--+"),
    42: (0xBDD732262FEB6E95, [0x9DC96EC4, 0x0B9F56F3, 0x24EEB40A, 0x8A7CDD6B],
         "++-+++--+---+--+-++-++---+---++-"),
    2**64 - 1: (0xE4D971771B652C20, [0x3D53FA30, 0x7102F05E, 0x3CC6428C, 0xB86C8620],
                "++++--+++-+-------++-+-+-+----++"),
}


class TestAgreement:
    @pytest.mark.parametrize("seed", SEEDS)
    @pytest.mark.parametrize(("size", "offset"), [(1, 0), (31, 1), (32, 32), (1000, 7),
                                                  (70_001, 12_345), (2**21 + 3, 0)])
    def test_torch_matches_numpy_reference(self, seed: int, size: int, offset: int) -> None:
        # Execute
        fast = prng.rademacher(seed, size, offset=offset)
        reference = prng.rademacher_reference(seed, size, offset=offset)

        # Assert
        assert fast.dtype == torch.float32 and fast.shape == (size,)
        assert fast.numpy().tobytes() == reference.tobytes()

    @pytest.mark.parametrize("seed", SEEDS)
    def test_matches_plain_python_spec(self, seed: int) -> None:
        positions = [0, 1, 31, 32, 33, 1000, 2**20 + 17]
        expected = [_value_python(seed, i) for i in positions]
        got = [float(prng.rademacher(seed, 1, offset=i)[0]) for i in positions]
        assert got == expected

    def test_hash_words_match_reference(self) -> None:
        for seed in SEEDS:
            fast = prng.hash_words(seed, 5000, offset=123)
            assert fast.dtype == torch.int64
            assert np.array_equal(fast.numpy(), prng.hash_words_reference(seed, 5000, offset=123))

    @pytest.mark.parametrize(("first", "count"), [(0, 1), (3, 100), (2**20 + 5, 777),
                                                  (2**32 - 10, 10)])
    def test_hash_words_into_matches_reference(self, first: int, count: int) -> None:
        out = np.empty(count, dtype=np.uint32)
        scratch = np.empty(count + 3, dtype=np.uint32)
        counter = np.arange(count + 3, dtype=np.uint32)
        for seed in SEEDS:
            prng.hash_words_into(prng.stream_keys(seed), first, out, scratch, counter)
            expected = prng.hash_words_reference(seed, count, offset=first)
            assert np.array_equal(out, expected)

    def test_hash_words_into_refuses_words_past_the_stream(self) -> None:
        out = np.empty(4, dtype=np.uint32)
        with pytest.raises(ValueError, match="outside"):
            prng.hash_words_into((1, 2), 2**32 - 3, out, out.copy(), np.arange(4, dtype=np.uint32))


class TestKnownVectors:
    @pytest.mark.parametrize("seed", sorted(VECTORS))
    def test_keys_words_and_first_values(self, seed: int) -> None:
        mixed, words, signs = VECTORS[seed]
        assert prng.splitmix64(seed) == mixed
        assert prng.stream_keys(seed) == (mixed & _M32, mixed >> 32)
        assert [int(w) for w in prng.hash_words(seed, 4)] == words
        assert _signs(prng.rademacher(seed, 32)) == signs

    def test_offset_vector(self) -> None:
        assert _signs(prng.rademacher(42, 16, offset=1000)) == "+--+----++-+--+-"

    def test_derive_seed_vector(self) -> None:
        assert prng.derive_seed(42, 0) == 0x57E1FABA65107204
        assert prng.derive_seed(42, 1) == 0xF34FE9248C9342E5


class TestSlicing:
    @pytest.mark.parametrize("block", [1, 5, 32, 100, 4096, 1 << 20])
    def test_blocks_concatenate_to_the_full_stream(self, block: int) -> None:
        # Prepare
        size, offset = min(50_003, 300 * block + 7), 77
        full = prng.rademacher(9, size, offset=offset)

        # Execute
        pieces = list(prng.iter_rademacher(9, size, block=block, offset=offset))

        # Assert
        assert [start for start, _ in pieces] == list(range(0, size, block))
        assert torch.equal(torch.cat([z for _, z in pieces]), full)

    def test_offset_reads_inside_the_stream(self) -> None:
        full = prng.rademacher(3, 10_000)
        for offset, size in [(0, 10_000), (1, 64), (31, 2), (4000, 5999), (9999, 1)]:
            assert torch.equal(prng.rademacher(3, size, offset=offset), full[offset:offset + size])

    def test_far_offsets_near_the_end_of_the_stream(self) -> None:
        end = prng.MAX_STREAM_LENGTH
        tail = prng.rademacher(5, 100, offset=end - 100)
        reference = prng.rademacher_reference(5, 100, offset=end - 100)
        assert tail.numpy().tobytes() == reference.tobytes()
        assert float(tail[-1]) == _value_python(5, end - 1)

    def test_empty_request(self) -> None:
        assert prng.rademacher(1, 0).shape == (0,)
        assert prng.rademacher_reference(1, 0).shape == (0,)


class TestStatistics:
    def test_values_are_exactly_plus_or_minus_one(self) -> None:
        z = prng.rademacher(11, 100_000)
        assert torch.all((z == 1.0) | (z == -1.0))

    def test_balanced_and_uncorrelated(self) -> None:
        n = 1 << 20
        z = prng.rademacher(2024, n).double()
        other = prng.rademacher(2025, n).double()  # neighbouring seed
        bound = 5 / np.sqrt(n)  # five standard deviations
        assert abs(float(z.mean())) < bound
        assert abs(float((z[1:] * z[:-1]).mean())) < bound  # lag 1
        assert abs(float((z[32:] * z[:-32]).mean())) < bound  # lag of one word
        assert abs(float((z * other).mean())) < bound

    def test_every_bit_position_is_balanced(self) -> None:
        words = prng.hash_words_reference(7, 1 << 16)
        bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        frequency = bits.mean(axis=0)
        assert np.all(np.abs(frequency - 0.5) < 5 * 0.5 / np.sqrt(words.size))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
    def test_values_survive_any_float_dtype_unchanged(self, dtype: torch.dtype) -> None:
        z = prng.rademacher(13, 4096)
        assert torch.equal(z.to(dtype).to(torch.float32), z)

    def test_seeds_give_different_streams(self) -> None:
        streams = {prng.rademacher(s, 64).numpy().tobytes() for s in range(200)}
        assert len(streams) == 200


class TestValidation:
    @pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5, "3"])
    def test_bad_seeds_are_refused(self, seed: object) -> None:
        with pytest.raises((ValueError, TypeError)):
            prng.rademacher(seed, 4)  # type: ignore[arg-type]

    def test_ranges_outside_the_stream_are_refused(self) -> None:
        with pytest.raises(ValueError, match="size"):
            prng.rademacher(1, -1)
        with pytest.raises(ValueError, match="offset"):
            prng.rademacher(1, 4, offset=-1)
        with pytest.raises(ValueError, match="stream length"):
            prng.rademacher(1, 2, offset=prng.MAX_STREAM_LENGTH - 1)
        with pytest.raises(ValueError, match="block"):
            list(prng.iter_rademacher(1, 10, block=0))

    def test_numpy_integer_seeds_are_accepted(self) -> None:
        assert torch.equal(prng.rademacher(np.uint64(2**63), 40), prng.rademacher(2**63, 40))

    def test_derived_seeds_are_distinct(self) -> None:
        children = {prng.derive_seed(5, i) for i in range(1000)}
        assert len(children) == 1000


def _accelerators() -> list[str]:
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("device", _accelerators() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no CUDA or MPS device"))])
def test_accelerator_stream_is_bit_identical_to_cpu(device: str) -> None:
    for seed, size, offset in [(0, 1, 0), (42, 1_000_003, 17), (2**64 - 1, 5_000_000, 2**33)]:
        on_device = prng.rademacher(seed, size, device=device, offset=offset)
        assert on_device.device.type == device
        assert on_device.cpu().numpy().tobytes() == \
            prng.rademacher(seed, size, offset=offset).numpy().tobytes()
    words = prng.hash_words(7, 100_000, device=device).cpu()
    assert np.array_equal(words.numpy(), prng.hash_words_reference(7, 100_000))


@pytest.mark.parametrize("size", [0, 1, 31, 32, 33, 650, 40_000])
def test_rows_of_many_streams_are_each_stream(size: int) -> None:
    """rademacher_rows draws a chunk of clients' directions at once; each row must be its
    seed's stream bit for bit, whatever the row count does to the passes it makes."""
    seeds = [0, 1, 5, 2**32 + 7, 2**63, 2**64 - 1] + list(range(100, 1100, 9))
    rows = prng.rademacher_rows(seeds, size)
    assert rows.shape == (len(seeds), size) and rows.dtype == torch.float32
    for i, seed in enumerate(seeds):
        assert torch.equal(rows[i], prng.rademacher(seed, size))
    assert prng.rademacher_rows([], size).shape == (0, size)


def test_rows_refuse_a_bad_seed() -> None:
    with pytest.raises(ValueError):
        prng.rademacher_rows([1, -1], 10)
