"""The serverless tier end to end: decoding in worker processes over real gRPC on loopback."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import numpy as np
import pytest

from murmura.client import ClientRuntime, FunctionTrainer, GrpcTransport, RemoteError, RetryPolicy
from murmura.protocols import (
    DeviceProfile,
    ModelSpec,
    TaskSettings,
    TensorSpec,
    UpdateHeader,
    create_codec,
)
from murmura.server import AggregatorCore, ServerConfig, ServerThread
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

SIZE = 20_000


def vector_spec(n: int = SIZE) -> ModelSpec:
    return ModelSpec((TensorSpec("w", (n,)),))


def update_for(client: int, version: int) -> np.ndarray:
    """A deterministic update per (client, version), with values over many magnitudes."""
    rng = np.random.default_rng([client, version])
    return (rng.standard_normal(SIZE) * 10.0 ** rng.integers(-6, 1, SIZE)).astype(np.float32)


def run_sync(serve, *, workers: int, codec: str = "int8", clients: int = 5, versions: int = 3,
             accumulator: str = "float32", options: dict[str, str] | None = None) -> np.ndarray:
    """``versions`` sync rounds of ``clients`` pushing concurrently; the final model."""
    cfg = ServerConfig.from_flat(min_clients=clients, max_versions=versions, workers=workers,
                                 require_identity=False,
                                 max_workers=max(workers, 1), accumulator=accumulator,
                                 train=TaskSettings(codec=codec, codec_options=options or {}))
    srv = serve(AggregatorCore(cfg, vector_spec(), np.zeros(SIZE, np.float32)))
    t = GrpcTransport(srv.address, timeout_s=30)
    sessions = [t.join(f"client-{i}", DeviceProfile())[0].session for i in range(clients)]
    codec_obj = create_codec(codec, options or {})
    for _ in range(versions):
        tasks = [t.task(s, 5.0) for s in sessions]
        version = tasks[0].version

        def push(i: int, version: int, round_: int) -> None:
            payload = codec_obj.encoder(SIZE, seed=i).encode(update_for(i, version))
            t.push(UpdateHeader(session=sessions[i], update_id=uuid.uuid4().hex[:12],
                                base_version=version, round=round_,
                                num_examples=10 + i, codec=codec, payload_bytes=len(payload),
                                spec_fingerprint=vector_spec().fingerprint()),
                   payload)
        # reverse start order so that arrivals are out of cohort order
        threads = [threading.Thread(target=push, args=(i, version, tasks[i].round))
                   for i in reversed(range(clients))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wait_until(lambda v=version: t.pull(sessions[0])[0] == v + 1, what="the next version")
    params = t.pull(sessions[0])[1]
    t.close()
    return params


@pytest.mark.slow
def test_sync_fedavg_is_bit_identical_with_0_1_2_and_4_workers(serve) -> None:
    models = {w: run_sync(serve, workers=w) for w in (0, 1, 2, 4)}
    for w in (1, 2, 4):
        assert np.array_equal(models[w], models[0]), f"{w} workers differ from in-process"
    assert np.abs(models[0]).sum() > 0


def test_topk_and_exact_accumulation_through_workers_match_in_process(serve) -> None:
    opts = {"ratio": "0.05"}
    inline = run_sync(serve, workers=0, codec="topk", options=opts, accumulator="exact",
                      versions=2)
    workers = run_sync(serve, workers=2, codec="topk", options=opts, accumulator="exact",
                       versions=2)
    assert np.array_equal(inline, workers)


def _core(**cfg) -> AggregatorCore:
    cfg.setdefault("min_clients", 1)
    cfg.setdefault("require_identity", False)  # raw legacy joins; tests/security: identities
    return AggregatorCore(ServerConfig.from_flat(**cfg), vector_spec(), np.zeros(SIZE, np.float32))


def _push(t: GrpcTransport, session: str, version: int = 0, value: float = 1.0,
          update_id: str | None = None) -> object:
    payload = np.full(SIZE, value, "<f4").tobytes()
    return t.push(UpdateHeader(session=session, update_id=update_id or uuid.uuid4().hex[:12],
                               base_version=version, round=0, num_examples=1,
                               codec="dense-f32", payload_bytes=len(payload),
                               spec_fingerprint=vector_spec().fingerprint()), payload)


def test_idle_workers_stop_and_the_pool_scales_from_zero(serve) -> None:
    srv = serve(_core(mode="async", buffer_size=1, max_versions=100, max_workers=2,
                      worker_idle_s=0.3))
    tier = srv.server.tier
    assert srv.call(lambda: tier.stats()["workers"]) == 0  # nothing runs before work arrives
    t = GrpcTransport(srv.address, timeout_s=30)
    s = t.join("a", DeviceProfile())[0].session
    _push(t, s)
    stats = srv.call(tier.stats)
    assert stats["cold_starts"] >= 1 and stats["decoded"] == 1
    wait_until(lambda: srv.call(lambda: tier.stats()["workers"]) == 0, what="idle workers to stop")
    _push(t, s, version=1)  # a new cold start after scaling to zero
    assert srv.call(lambda: tier.stats()["cold_starts"]) >= 2
    assert t.pull(s)[0] == 2
    t.close()


def test_back_pressure_refuses_with_a_retry_hint_and_the_runtime_backs_off(serve) -> None:
    srv = serve(_core(mode="async", buffer_size=1, max_versions=1, slab_mb=1.0))
    tier = srv.server.tier
    hog = srv.call(lambda: tier.slabs.acquire(1 << 20))  # every byte of shared memory is taken
    assert hog is not None
    t = GrpcTransport(srv.address, timeout_s=30)
    s = t.join("probe", DeviceProfile())[0].session
    with pytest.raises(RemoteError) as err:
        _push(t, s)
    assert err.value.status == "RESOURCE_EXHAUSTED" and err.value.retry_after_s is not None
    assert err.value.retryable and "busy" in err.value.message
    assert srv.call(lambda: srv.core.traffic.updates) == 0
    t.close()

    # A runtime keeps retrying its push while the aggregator is busy; once memory frees up the
    # update is taken, exactly once.
    model = torch_linear()
    trainer = FunctionTrainer(model, lambda m, settings, seed: {"num_examples": 3})
    runtime = ClientRuntime(GrpcTransport(srv.address, timeout_s=30), trainer, client_id="c",
                            retry=RetryPolicy(initial_s=0.05, max_s=0.2, give_up_after_s=60))
    worker = threading.Thread(target=runtime.run)
    worker.start()
    wait_until(lambda: runtime.stats.retries >= 2, what="the runtime to retry")
    srv.call(lambda: tier.slabs.release(hog))
    worker.join(timeout=60)
    assert runtime.stats.pushed == 1 and runtime.stats.refused == 0
    assert srv.call(lambda: (srv.core.version, srv.core.traffic.updates)) == (1, 1)


def torch_linear():  # noqa: ANN201 - a module whose spec is vector_spec()
    import torch

    class Vec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(SIZE))

    return Vec()


def test_join_and_get_task_answer_while_a_version_is_being_published(serve) -> None:
    gate, started = threading.Event(), threading.Event()

    def slow_evaluator(params: np.ndarray) -> dict[str, float]:
        started.set()
        gate.wait(30)
        return {"accuracy": 0.5}

    cfg = ServerConfig.from_flat(min_clients=1, mode="async", buffer_size=1, max_versions=5,
                                 require_identity=False)
    srv = serve(AggregatorCore(cfg, vector_spec(), np.zeros(SIZE, np.float32),
                               evaluator=slow_evaluator))
    t = GrpcTransport(srv.address, timeout_s=30)
    s = t.join("a", DeviceProfile())[0].session
    pusher = threading.Thread(target=_push, args=(t, s))
    pusher.start()
    assert started.wait(20)  # the publisher is inside evaluation now
    probe = GrpcTransport(srv.address, timeout_s=5)
    b = probe.join("b", DeviceProfile())[0].session
    assert probe.task(b, 0).action.name == "TRAIN"
    assert probe.pull(b)[0] == 0  # the old version is served until the new one is out
    assert pusher.is_alive()  # the push that completes the version waits for it
    gate.set()
    pusher.join(30)
    assert probe.pull(b)[0] == 1
    probe.close()
    t.close()


def seed_payload(size: int, steps: int) -> bytes:
    """A zeroth-order update of ``steps`` seeded steps: tiny, but slow to replay."""
    import torch

    enc = create_codec("seed", {}).encoder(size, seed=1)
    theta = torch.zeros(size)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        enc.step(theta, seed=enc.next_seed(), g=float(rng.standard_normal()), lr=1e-3)
    return enc.encode(np.zeros(size, np.float32))


def seed_server(serve, size: int, **cfg) -> ServerThread:  # noqa: ANN003
    config = ServerConfig.from_flat(min_clients=1, mode="async", buffer_size=1, max_versions=2,
                                    require_identity=False,
                                    train=TaskSettings(trainer="zo", codec="seed"), **cfg)
    spec = ModelSpec((TensorSpec("w", (size,)),))
    return serve(AggregatorCore(config, spec, np.zeros(size, np.float32)))


@pytest.mark.slow
def test_rpcs_are_answered_while_a_worker_replays_a_slow_seed_update(serve) -> None:
    """The issue's case: a few hundred bytes that take a long time to decode must not hold
    the other clients' Join, GetTask and Pull."""
    size = 1_000_000
    srv = seed_server(serve, size, max_workers=1)
    payload = seed_payload(size, 1000)  # about two seconds of replay on the dev VM
    t = GrpcTransport(srv.address, timeout_s=120)
    s = t.join("slow", DeviceProfile())[0].session
    header = UpdateHeader(session=s, update_id="slow-update-1", base_version=0, round=0,
                          num_examples=1, codec="seed", payload_bytes=len(payload),
                          spec_fingerprint=vector_spec(size).fingerprint())
    pusher = threading.Thread(target=t.push, args=(header, payload))
    pusher.start()
    backend = srv.server.tier.backend
    wait_until(lambda: srv.call(lambda: backend.stats()["busy"]) == 1, what="a busy worker")
    probe = GrpcTransport(srv.address, timeout_s=5)
    for i in range(5):
        b = probe.join(f"probe-{i}", DeviceProfile())[0].session
        assert probe.task(b, 0).action.name == "TRAIN"
        assert probe.pull(b)[0] == 0
    assert srv.call(lambda: backend.stats()["busy"]) == 1  # the decode was still running
    pusher.join(120)
    assert srv.call(lambda: srv.core.version) == 1
    probe.close()
    t.close()


@pytest.mark.slow
def test_a_worker_killed_mid_decode_is_replaced_and_the_update_counted_once(serve) -> None:
    """Seed replay of many steps keeps a worker busy long enough to kill it mid-job."""
    size = 400_000
    srv = seed_server(serve, size, max_workers=1)
    payload = seed_payload(size, 600)
    t = GrpcTransport(srv.address, timeout_s=120)
    s = t.join("a", DeviceProfile())[0].session
    header = UpdateHeader(session=s, update_id="kill-me-0001", base_version=0, round=0,
                          num_examples=1, codec="seed", payload_bytes=len(payload),
                          spec_fingerprint=vector_spec(size).fingerprint())
    result: list[object] = []
    pusher = threading.Thread(target=lambda: result.append(t.push(header, payload)))
    pusher.start()
    backend = srv.server.tier.backend
    wait_until(lambda: srv.call(lambda: backend.stats()["busy"]) == 1, what="a busy worker")
    pids = srv.call(lambda: backend.worker_pids(busy_only=True))
    os.kill(pids[0], signal.SIGKILL)
    pusher.join(120)
    assert result and not result[0].duplicate
    stats = srv.call(backend.stats)
    assert stats["crashes"] == 1 and stats["retries"] == 1
    assert srv.call(lambda: (srv.core.version, srv.core.traffic.updates)) == (1, 1)
    again = t.push(header, payload)  # a retry of the same update is answered, not re-counted
    assert again.duplicate and srv.call(lambda: srv.core.traffic.updates) == 1
    t.close()


@pytest.mark.slow
def test_the_ray_backend_decodes_like_the_in_process_path(serve) -> None:
    """``--backend ray`` on a local Ray the server starts (and stops with itself)."""
    pytest.importorskip("ray", reason="Ray is an extra: pip install -e \".[ray]\" (in dev)")
    inline = run_sync(serve, workers=0, codec="int8", clients=3, versions=2)
    cfg = ServerConfig.from_flat(min_clients=3, max_versions=2, backend="ray",
                                 require_identity=False, train=TaskSettings(codec="int8"))
    core = AggregatorCore(cfg, vector_spec(), np.zeros(SIZE, np.float32))
    srv = ServerThread(core, "127.0.0.1:0").start()
    try:
        assert type(srv.server.tier.backend).__name__ == "RayBackend"
        t = GrpcTransport(srv.address, timeout_s=120)
        sessions = [t.join(f"client-{i}", DeviceProfile())[0].session for i in range(3)]
        codec = create_codec("int8", {})
        for _ in range(2):
            tasks = [t.task(s, 5.0) for s in sessions]
            version = tasks[0].version
            for i in range(3):
                payload = codec.encoder(SIZE, seed=i).encode(update_for(i, version))
                t.push(UpdateHeader(session=sessions[i], update_id=uuid.uuid4().hex[:12],
                                    base_version=version, round=tasks[i].round,
                                    num_examples=10 + i, codec="int8",
                                    payload_bytes=len(payload),
                                    spec_fingerprint=vector_spec().fingerprint()), payload)
        assert t.pull(sessions[0])[0] == 2
        assert np.array_equal(t.pull(sessions[0])[1], inline)
        assert srv.call(lambda: srv.server.tier.backend.stats()["jobs_done"]) == 6
        t.close()
    finally:
        srv.stop(grace=None)
    import ray

    assert not ray.is_initialized()  # the server's Ray went with it
