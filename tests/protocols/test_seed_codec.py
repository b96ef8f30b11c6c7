"""Seed-based zeroth-order updates: the server rebuilds a MeZO client's model bit for bit."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import numpy.typing as npt
import pytest
import torch

from murmura.protocols.codecs import seed as zo
from murmura.protocols.codecs import seed_steps
from murmura.protocols.codecs.base import CodecError, create_codec

F32 = npt.NDArray[np.float32]


def _digest(vector: torch.Tensor | F32) -> str:
    array = vector.detach().cpu().numpy() if isinstance(vector, torch.Tensor) else vector
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


class TinyRegression:
    """A 4-8-1 tanh network on a flat parameter vector, with a mean-squared-error loss."""

    size = 4 * 8 + 8 + 8 + 1

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(64, 4, generator=generator)
        target = self.inputs @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.3
        self.target = target.unsqueeze(1)
        self.initial = (0.5 * torch.randn(self.size, generator=generator)).numpy()

    def loss(self, theta: torch.Tensor) -> float:
        w1, b1 = theta[:32].view(8, 4), theta[32:40]
        w2, b2 = theta[40:48].view(1, 8), theta[48:49]
        out = torch.tanh(self.inputs @ w1.T + b1) @ w2.T + b2
        return float(((out - self.target) ** 2).mean())


def _train_client(codec: zo.SeedCodec, start: F32, loss: object, *, steps: int, lr: float = 1e-2,
                  pool: zo.SeedPool | None = None, client: int = 0) -> tuple[torch.Tensor, bytes]:
    """MeZO on the client: estimate g along z(seed), step, record; return the model and payload."""
    theta = torch.from_numpy(start.copy())
    encoder = codec.encoder(start.size, seed=100 + client)
    rng = np.random.default_rng(client)
    for _ in range(steps):
        seed = pool.sample(rng) if pool is not None else encoder.next_seed()
        g = zo.zo_gradient(loss, theta, seed=seed, eps=1e-3)  # type: ignore[arg-type]
        encoder.step(theta, seed=seed, g=g, lr=lr)
    return theta, encoder.encode(theta.numpy() - start)


@pytest.fixture(scope="module")
def task() -> TinyRegression:
    return TinyRegression()


class TestExactReplay:
    @pytest.mark.parametrize("options", [{}, {"dtype": "int8"}, {"seed_bits": "64"},
                                         {"dtype": "int8", "gclip": "50"}])
    def test_replay_reproduces_a_mezo_trained_model_bit_for_bit(self, task: TinyRegression,
                                                               options: dict[str, str]) -> None:
        # Prepare
        codec = create_codec("seed", options)
        assert isinstance(codec, zo.SeedCodec)

        # Execute
        client_model, payload = _train_client(codec, task.initial, task.loss, steps=150)
        server_model = zo.replay(task.initial, codec.unpack(payload))
        delta = codec.decode(payload, task.size, reference=task.initial)

        # Assert
        assert _digest(server_model) == _digest(client_model)
        assert np.array_equal(delta, server_model - task.initial)
        assert task.loss(client_model) < 0.5 * task.loss(torch.from_numpy(task.initial))

    def test_replay_is_independent_of_block_size_and_input_type(self, task: TinyRegression
                                                                ) -> None:
        codec = create_codec("seed")
        assert isinstance(codec, zo.SeedCodec)
        _, payload = _train_client(codec, task.initial, task.loss, steps=40)
        steps = codec.unpack(payload)
        models = [zo.replay(task.initial, steps, block=block) for block in (1, 7, 32, 1 << 20)]
        models.append(zo.replay(torch.from_numpy(task.initial), steps).numpy())
        assert len({_digest(m) for m in models}) == 1

    def test_one_step_is_the_exact_sum_rounded_once(self) -> None:
        # Prepare: float64 holds these sums exactly, so casting once is the correct rounding
        start = torch.tensor([1.0, -1.0, 3.0e-8, 0.0, 1e7, 0.1], dtype=torch.float32)
        coeff = zo.step_coefficient(0.1, 2.5)
        z = zo.prng.rademacher(0, 6)
        expected = (start.double() + z.double() * float(coeff)).float()

        # Execute
        theta = start.clone()
        zo.apply_step(theta, 0, coeff)

        # Assert
        assert torch.equal(theta, expected)

    def test_large_vector_replay_matches_a_stepwise_reference(self) -> None:
        # Prepare: 100 000 values, so several blocks of the default size are walked
        start = np.random.default_rng(1).standard_normal(100_003).astype(np.float32)
        seeds = np.arange(20, dtype=np.uint64) * 7919
        grads = np.random.default_rng(2).standard_normal(20).astype(np.float32)
        steps = zo.ZOSteps(1e-3, seeds, grads)

        # Execute
        replayed = zo.replay(start, steps)
        reference = start.copy()
        for seed, coeff in zip(seeds, steps.coefficients, strict=True):
            reference = (reference + zo.prng.rademacher_reference(int(seed), reference.size)
                         * coeff).astype(np.float32)

        # Assert
        assert _digest(replayed) == _digest(reference)

    @pytest.mark.parametrize(("size", "block"), [(1, 1), (31, 7), (33, 32), (1000, 100),
                                                 (4099, 1000), (70_001, 65_536), (5, 1 << 16)])
    def test_cpu_kernel_is_bit_identical_to_the_device_loop(self, size: int, block: int) -> None:
        # Prepare: blocks that start mid-word and straddle words; a zero and a -0.0 step
        rng = np.random.default_rng(size)
        start = rng.standard_normal(size).astype(np.float32)
        seeds = [int(s) for s in rng.integers(0, 2**63, size=12)]
        coeffs = [float(np.float32(c)) for c in rng.standard_normal(12) * 1e-3]
        coeffs[3], coeffs[7] = 0.0, -0.0
        steps = [(s, c) for s, c in zip(seeds, coeffs, strict=True) if c != 0.0]
        fast, loop = torch.from_numpy(start.copy()), torch.from_numpy(start.copy())

        # Execute
        seed_steps._apply_steps_cpu(fast, steps, block)
        seed_steps._apply_steps_device(loop, steps, block)

        # Assert
        assert _digest(fast) == _digest(loop)
        assert _digest(fast) != _digest(start)

    def test_cpu_kernel_leaves_the_thread_count_as_it_found_it(self) -> None:
        before = torch.get_num_threads()
        zo.apply_steps(torch.zeros(100), [1, 2], [0.5, -0.25])
        assert torch.get_num_threads() == before

    def test_decode_into_matches_decode_and_leaves_the_reference_alone(self) -> None:
        # Prepare
        codec = zo.SeedCodec()
        encoder = codec.encoder(5000, seed=4)
        theta = torch.zeros(5000)
        for _ in range(5):
            encoder.step(theta, seed=encoder.next_seed(), g=0.7, lr=1e-2)
        payload = encoder.encode(np.zeros(5000, np.float32))
        reference = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
        kept = reference.copy()
        out = np.full(5000, np.nan, dtype=np.float32)

        # Execute
        got = codec.decode_into(payload, out, reference=reference)

        # Assert
        assert got is out
        assert _digest(out) == _digest(codec.decode(payload, 5000, reference=reference))
        assert np.array_equal(reference, kept)

    def test_zo_gradient_leaves_theta_untouched(self, task: TinyRegression) -> None:
        theta = torch.from_numpy(task.initial.copy())
        before = _digest(theta)
        zo.zo_gradient(task.loss, theta, seed=3, eps=1e-3)
        assert _digest(theta) == before


class TestPayload:
    def test_two_hundred_steps_fit_in_well_under_4_kib_for_any_model_size(self) -> None:
        codec = create_codec("seed")
        for size in (10, 1_000_000):
            encoder = codec.encoder(size)
            theta = torch.zeros(size)
            for _ in range(200):
                encoder.step(theta, seed=encoder.next_seed(), g=0.0, lr=1e-3)
            assert len(encoder.encode(np.zeros(size, dtype=np.float32))) == 16 + 200 * 6 == 1216
        assert create_codec("seed", {"dtype": "int8"}).payload_bytes(200) == 16 + 200 * 5
        assert create_codec("seed", {"seed_bits": "64"}).payload_bytes(200) == 16 + 200 * 10
        assert codec.max_payload_bytes(10**9) == 16 + 1024 * 6

    def test_encode_starts_a_new_log(self) -> None:
        codec = create_codec("seed")
        assert isinstance(codec, zo.SeedCodec)
        encoder = codec.encoder(4)
        encoder.step(torch.zeros(4), seed=1, g=1.0, lr=0.5)
        assert len(codec.unpack(encoder.encode(np.zeros(4, dtype=np.float32)))) == 1
        assert len(codec.unpack(encoder.encode(np.zeros(4, dtype=np.float32)))) == 0

    def test_wire_rounding_is_what_the_client_applies(self) -> None:
        codec = create_codec("seed")
        assert isinstance(codec, zo.SeedCodec)
        encoder = codec.encoder(3)
        coeff = encoder.step(torch.zeros(3), seed=5, g=0.1, lr=1.0)
        assert coeff == np.float32(-np.float32(np.float16(0.1)))

    def test_int8_clips_at_gclip(self) -> None:
        codec = create_codec("seed", {"dtype": "int8", "gclip": "1.27"})
        assert isinstance(codec, zo.SeedCodec)
        encoder = codec.encoder(3)
        theta = torch.zeros(3)
        encoder.step(theta, seed=1, g=0.5, lr=1.0)
        encoder.step(theta, seed=2, g=-9.0, lr=1.0)
        assert encoder.clipped == 1
        steps = codec.unpack(encoder.encode(np.zeros(3, dtype=np.float32)))
        assert np.allclose(steps.grads, [0.5, -1.27])


def _payload(*, flags: int = 0, lr: float = 0.01, count: int = 2, gscale: float = 0.0,
             seeds: bytes | None = None, scalars: bytes | None = None) -> bytes:
    seeds = struct.pack(f"<{count}I", *range(count)) if seeds is None else seeds
    scalars = np.ones(count, dtype="<f2").tobytes() if scalars is None else scalars
    return bytes([0xB5, ord("z"), 1, flags]) + struct.pack("<fIf", lr, count, gscale) + seeds \
        + scalars


class TestMalformedPayloads:
    @pytest.mark.parametrize(("payload", "message"), [
        (_payload()[:10], "shorter than the 16-byte header"),
        (_payload()[:2], "shorter than the 4-byte header"),
        (_payload() + b"\0", "bytes, expected 28"),
        (_payload()[:-1], "bytes, expected 28"),
        (_payload(count=5000), "exceed max_steps"),
        (_payload(lr=float("nan")), "learning rate nan"),
        (_payload(lr=-1.0), "learning rate -1.0"),
        (_payload(lr=0.0), "learning rate 0.0"),
        (_payload(gscale=2.0), "gscale must be 0"),
        (_payload(scalars=np.array([1, np.inf], dtype="<f2").tobytes()), "step 1 is inf"),
        (_payload(flags=1, gscale=0.5, scalars=b"\x01\x02"), "flags"),
        (_payload(flags=4), "flags"),
        (_payload(lr=3e38, scalars=np.array([1, 60000], dtype="<f2").tobytes()), "overflows"),
    ])
    def test_refused_with_a_precise_message(self, payload: bytes, message: str) -> None:
        with pytest.raises(CodecError, match=message):
            create_codec("seed").decode(payload, 3, reference=np.zeros(3, dtype=np.float32))

    @pytest.mark.parametrize(("payload", "message"), [
        (_payload(flags=1, gscale=0.5, scalars=b"\x01\x80"), "step 1 is -128"),
        (_payload(flags=1, gscale=float("nan"), scalars=b"\x01\x02"), "int8 step nan"),
        (_payload(flags=1, gscale=0.0, scalars=b"\x01\x02"), "int8 step 0.0"),
    ])
    def test_int8_payloads_are_checked(self, payload: bytes, message: str) -> None:
        with pytest.raises(CodecError, match=message):
            create_codec("seed", {"dtype": "int8"}).decode(
                payload, 3, reference=np.zeros(3, dtype=np.float32))

    def test_decoding_needs_a_matching_reference(self) -> None:
        codec = create_codec("seed")
        with pytest.raises(CodecError, match="needs the reference"):
            codec.decode(_payload(), 3)
        with pytest.raises(CodecError, match="reference has shape"):
            codec.decode(_payload(), 3, reference=np.zeros(4, dtype=np.float32))

    @pytest.mark.parametrize("options", [{"dtype": "bf16"}, {"seed_bits": "16"},
                                         {"max_steps": "0"}, {"gclip": "1"},
                                         {"dtype": "int8", "gclip": "-1"}])
    def test_options_are_validated(self, options: dict[str, str]) -> None:
        with pytest.raises(CodecError, match="option"):
            create_codec("seed", options)


class TestClientGuards:
    def test_coefficients_must_be_float32_values(self) -> None:
        with pytest.raises(ValueError, match="float32"):
            zo.apply_step(torch.zeros(4), 1, 0.1)  # 0.1 is not a float32 value

    def test_theta_must_be_flat_float32(self) -> None:
        with pytest.raises(ValueError, match="float32"):
            zo.apply_step(torch.zeros(4, dtype=torch.float64), 1, np.float32(0.5))
        with pytest.raises(ValueError, match="1-D"):
            zo.apply_step(torch.zeros(2, 2), 1, np.float32(0.5))

    def test_learning_rate_is_fixed_within_a_payload(self) -> None:
        encoder = create_codec("seed").encoder(4)
        encoder.step(torch.zeros(4), seed=1, g=1.0, lr=0.1)  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="lr changed"):
            encoder.step(torch.zeros(4), seed=2, g=1.0, lr=0.2)  # type: ignore[attr-defined]

    def test_seed_width_and_finite_g_are_checked(self) -> None:
        encoder = create_codec("seed").encoder(4)
        with pytest.raises(ValueError, match="32 bits"):
            encoder.step(torch.zeros(4), seed=2**32, g=1.0, lr=0.1)  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="not finite"):
            encoder.step(torch.zeros(4), seed=1, g=float("nan"), lr=0.1)  # type: ignore[attr-defined]


class TestSeedPool:
    def test_pool_seeds_are_distinct_deterministic_and_indexed(self) -> None:
        pool = zo.SeedPool(64, 9)
        assert len(set(pool.seeds)) == 64 == len(pool)
        assert pool.seeds == zo.SeedPool(64, 9).seeds != zo.SeedPool(64, 10).seeds
        assert all(pool.index(s) == i for i, s in enumerate(pool.seeds))
        assert all(s < 2**32 for s in pool.seeds)
        with pytest.raises(ValueError, match="not in the pool"):
            pool.index(next(s for s in range(100) if s not in pool.seeds))

    def test_late_client_catches_up_exactly_from_k_numbers(self, task: TinyRegression) -> None:
        # Prepare: FedKSeed with 2 clients a round; the server keeps float64 sums and publishes
        # float32 cumulative scalars; the global model is defined by pool_model.
        codec = create_codec("seed")
        assert isinstance(codec, zo.SeedCodec)
        pool, base = zo.SeedPool(16, 2024), task.initial
        sums = np.zeros(len(pool), dtype=np.float64)
        published = sums.astype(np.float32)

        # Execute: three rounds
        for round_ in range(3):
            start = zo.pool_model(base, pool, published)
            for client in range(2):
                _, payload = _train_client(codec, start, task.loss, steps=25, pool=pool,
                                           client=10 * round_ + client)
                sums += 0.5 * pool.contribution(codec.unpack(payload))
            published = sums.astype(np.float32)
        server = zo.pool_model(base, pool, published)
        late = torch.from_numpy(base.copy())  # never took part: has the base and 16 numbers
        zo.apply_pool(late, pool, published.copy(), block=5)

        # Assert
        assert _digest(late) == _digest(server)
        assert task.loss(late) < task.loss(torch.from_numpy(base))

    def test_steps_outside_the_pool_are_refused(self) -> None:
        pool = zo.SeedPool(4, 1)
        outsider = next(s for s in range(100) if s not in pool.seeds)
        steps = zo.ZOSteps(0.1, np.array([pool.seeds[0], outsider], dtype=np.uint64),
                           np.ones(2, dtype=np.float32))
        with pytest.raises(CodecError, match=f"seed {outsider} is not in the pool"):
            pool.contribution(steps)

    def test_contribution_sums_coefficients_per_pool_seed(self) -> None:
        pool = zo.SeedPool(3, 1)
        seeds = np.array([pool.seeds[2], pool.seeds[0], pool.seeds[2]], dtype=np.uint64)
        steps = zo.ZOSteps(0.5, seeds, np.array([1.0, 2.0, 4.0], dtype=np.float32))
        assert pool.contribution(steps).tolist() == [-1.0, 0.0, -2.5]

    def test_cumulative_must_be_float32_of_pool_size(self) -> None:
        pool = zo.SeedPool(3, 1)
        with pytest.raises(ValueError, match="float32"):
            zo.apply_pool(torch.zeros(4), pool, np.zeros(3))
        with pytest.raises(ValueError, match="shape"):
            zo.apply_pool(torch.zeros(4), pool, np.zeros(4, dtype=np.float32))


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
def test_replay_on_an_accelerator_matches_cpu_bit_for_bit(device: str) -> None:
    start = np.random.default_rng(3).standard_normal(1_000_003).astype(np.float32)
    grads = np.random.default_rng(4).standard_normal(50).astype(np.float32)
    steps = zo.ZOSteps(1e-3, np.arange(50, dtype=np.uint64) * 101 + 7, grads)
    on_device = zo.replay(torch.from_numpy(start).to(device), steps)
    assert on_device.device.type == device
    assert _digest(on_device) == _digest(zo.replay(start, steps))
