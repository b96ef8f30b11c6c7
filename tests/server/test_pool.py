"""FedKSeed seed pools: aggregation in pool coordinates and exact catch-up from K scalars."""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest
import torch

from murmura.client import ClientRuntime
from murmura.client.zo import ZOTrainer
from murmura.protocols import DeviceProfile, ModelSpec, TaskSettings, UpdateHeader, create_codec
from murmura.protocols.codecs.seed import SeedCodec, ZOSteps, pool_model, replay
from murmura.protocols.pool import seed_pool_for
from murmura.server import AggregatorCore, ServerConfig, ServiceError
from murmura.server.checkpoint import load_checkpoint
from murmura.tasks import evaluate
from tests.client.core_transport import CoreTransport, drive

K = 64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(**kw) -> ServerConfig:
    """A config for legacy (unsigned) client ids; tests/security covers identities."""
    return ServerConfig.from_flat(require_identity=False, **kw)


def sha256(vector: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(vector, dtype=np.float32).tobytes()).hexdigest()


def pool_settings(k: int = K, **overrides: object) -> TaskSettings:
    base = dict(trainer="zo", codec="seed", codec_options={"pool": str(k)}, local_epochs=0,
                local_steps=60, batch_size=32, lr=8e-3, zo_eps=1e-3, seed=7)
    base.update(overrides)
    return TaskSettings(**base)  # type: ignore[arg-type]


def start_vector(digits) -> tuple[ModelSpec, np.ndarray]:
    model = digits.build_model(seed=0)
    spec = ModelSpec.from_module(model)
    return spec, spec.flatten(model)


def runtimes_for(core: AggregatorCore, digits, n: int, *, first: int = 0) -> list[ClientRuntime]:
    return [ClientRuntime(CoreTransport(core),
                          ZOTrainer(digits.build_model(), digits.client_data(i, 4), device="cpu",
                                    return_params=False),
                          client_id=f"client-{i}", wait_s=0) for i in range(first, first + n)]


def test_pool_run_learns_and_its_model_is_the_base_plus_k_scalars(digits) -> None:
    # Prepare: three ZO clients drawing from a pool of 64 seeds, sync rounds
    settings = pool_settings()
    spec, start = start_vector(digits)
    core = AggregatorCore(_cfg(mode="sync", min_clients=3, max_versions=4,
                                       train=settings), spec, start)
    runtimes = runtimes_for(core, digits, 3)
    model = digits.build_model()
    spec.load_into(model, start)
    before = evaluate(model, digits.test)

    # Execute
    drive(core, runtimes)

    # Assert: every pushed step seed is a pool seed, and the model is what the scalars define
    pool = seed_pool_for(settings)
    assert pool is not None and len(pool) == K and core.pool is not None
    codec = create_codec("seed", settings.codec_options)
    assert isinstance(codec, SeedCodec)
    for rt in runtimes:
        for _, payload in rt.transport.pushes:  # type: ignore[attr-defined]
            assert {int(s) for s in codec.unpack(payload).seeds} <= set(pool.seeds)
    assert core.version == 4
    assert sha256(core.params) == sha256(pool_model(start, pool, core.pool.scalars))
    spec.load_into(model, core.params)
    after = evaluate(model, digits.test)
    assert after["loss"] < before["loss"] - 0.1


def test_a_late_client_catches_up_exactly_from_k_scalars(digits) -> None:
    # Prepare: a pool run that has moved on four versions without the late client
    spec, start = start_vector(digits)
    core = AggregatorCore(_cfg(mode="sync", min_clients=2, max_versions=4,
                                       train=pool_settings()), spec, start)
    drive(core, runtimes_for(core, digits, 2))
    late = runtimes_for(core, digits, 1, first=3)[0]
    late._call(late._join)

    # Execute: the late client's pull (base once, then scalars)
    version, params = late._pull()
    again_version, again = late._pull()

    # Assert: bit-identical to the server's model, without a second base download
    assert version == again_version == core.version == 4
    assert sha256(params) == sha256(again) == sha256(core.params)
    assert late._pool_base is not None and late._pool_base[0] == 0
    assert sha256(late._pool_base[1]) == sha256(start)


def test_pool_aggregate_equals_fedavg_of_the_replayed_models(digits) -> None:
    # Prepare: one version from two clients with different example counts
    settings = pool_settings(local_steps=30)
    spec, start = start_vector(digits)
    core = AggregatorCore(_cfg(mode="sync", min_clients=2, max_versions=1,
                                       train=settings), spec, start)
    runtimes = runtimes_for(core, digits, 2)

    # Execute
    drive(core, runtimes)

    # Assert: the same weighted mean a model-space FedAvg of the replays gives, up to rounding
    codec = create_codec("seed", settings.codec_options)
    assert isinstance(codec, SeedCodec)
    weights, deltas = [], []
    for rt in runtimes:
        (header, payload), = rt.transport.pushes  # type: ignore[attr-defined]
        weights.append(header.num_examples)
        deltas.append(replay(start, codec.unpack(payload)) - start)
    expected = start + np.average(deltas, axis=0, weights=weights)
    np.testing.assert_allclose(core.params, expected, rtol=0, atol=2e-6)
    assert not np.array_equal(core.params, start)


def _join(core: AggregatorCore) -> str:
    return core.join(f"c-{uuid.uuid4().hex[:6]}", DeviceProfile()).session


def _header(core: AggregatorCore, session: str, payload: bytes, codec: str) -> UpdateHeader:
    return UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=0,
                        num_examples=10, codec=codec, payload_bytes=len(payload), round=1,
                        spec_fingerprint=core.fingerprint)


def _seed_payload(options: dict[str, str], seeds: list[int]) -> bytes:
    codec = create_codec("seed", options)
    assert isinstance(codec, SeedCodec)
    steps = ZOSteps(1e-3, np.asarray(seeds, dtype=np.uint64), np.ones(len(seeds), np.float32))
    return codec.pack(steps)


@pytest.mark.parametrize("case", ["dense update", "seed not in the pool", "pool flag missing"])
def test_pool_run_refuses_other_updates_and_keeps_its_model(digits, case: str) -> None:
    # Prepare
    settings = pool_settings()
    spec, start = start_vector(digits)
    core = AggregatorCore(_cfg(mode="async", buffer_size=1, min_clients=1,
                                       train=settings), spec, start)
    session = _join(core)
    pool = seed_pool_for(settings)
    assert pool is not None
    outsider = next(s for s in range(1, 10_000) if s not in set(pool.seeds))
    if case == "dense update":
        payload, codec = np.zeros(spec.size, np.float32).tobytes(), "dense-f32"
    elif case == "seed not in the pool":
        payload, codec = _seed_payload(settings.codec_options, [pool.seeds[0], outsider]), "seed"
    else:
        payload, codec = _seed_payload({}, [pool.seeds[0]]), "seed"
    before = sha256(core.params)

    # Execute
    with pytest.raises(ServiceError) as info:
        core.push(_header(core, session, payload, codec), payload)

    # Assert: a precise refusal; nothing moved
    assert info.value.status == "INVALID_ARGUMENT"
    assert {"dense update": "without the pool", "seed not in the pool": "not in the pool",
            "pool flag missing": "flags"}[case] in info.value.message
    assert sha256(core.params) == before and core.version == 0
    assert core.pool is not None and not core.pool.scalars.any()
    # ... and a good pool update is still taken afterwards
    good = _seed_payload(settings.codec_options, [pool.seeds[3]])
    core.push(_header(core, session, good, "seed"), good)
    assert core.version == 1 and core.pool.scalars[3] != 0


def test_runs_without_a_pool_refuse_pool_pulls() -> None:
    spec, start = ModelSpec.from_module(torch.nn.Linear(2, 2)), np.zeros(6, np.float32)
    core = AggregatorCore(_cfg(min_clients=1), spec, start)
    session = _join(core)
    for pull in (core.pool_scalars, core.pool_base):
        with pytest.raises(ServiceError) as info:
            pull(session)
        assert info.value.status == "FAILED_PRECONDITION" and "no seed pool" in info.value.message


def test_pool_config_needs_the_linear_server_optimizer() -> None:
    with pytest.raises(ValueError, match="only the linear 'fedavg'"):
        ServerConfig.from_flat(optimizer="fedadam", train=pool_settings())
    with pytest.raises(ValueError, match="pool"):
        ServerConfig.from_flat(train=pool_settings(k=-1))
    assert seed_pool_for(pool_settings(k=0)) is None
    assert seed_pool_for(TaskSettings()) is None


def test_pool_state_survives_a_checkpoint_and_a_different_pool_is_refused(
        digits, tmp_path) -> None:
    # Prepare: a checkpointed pool run
    settings = pool_settings()
    spec, start = start_vector(digits)
    path = tmp_path / "ckpt.npz"
    core = AggregatorCore(_cfg(mode="sync", min_clients=2, max_versions=2,
                                       train=settings), spec, start, checkpoint_path=path)
    drive(core, runtimes_for(core, digits, 2))
    assert core.pool is not None

    # Execute: resume from the checkpoint, with the same pool and with another one
    ckpt = load_checkpoint(path)
    resumed = AggregatorCore(_cfg(mode="sync", min_clients=2, max_versions=4,
                                          train=settings), spec, start, start=ckpt)

    # Assert
    assert resumed.pool is not None and resumed.version == 2
    assert resumed.pool.cumulative.dtype == np.float64
    np.testing.assert_array_equal(resumed.pool.cumulative, core.pool.cumulative)
    assert sha256(resumed.pool.base) == sha256(start)
    assert sha256(resumed.params) == sha256(core.params)
    with pytest.raises(ValueError, match="seed pool"):
        AggregatorCore(_cfg(mode="sync", min_clients=2, max_versions=4,
                                    train=pool_settings(k=32)), spec, start, start=ckpt)
