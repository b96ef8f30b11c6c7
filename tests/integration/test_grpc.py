"""Real aggregator and clients over gRPC on loopback (ephemeral ports, no sleeps)."""

from __future__ import annotations

import threading
import uuid

import grpc
import numpy as np
import pytest
import torch

from murmura.client import (
    ClientRuntime,
    FunctionTrainer,
    GrpcTransport,
    RemoteError,
    RetryPolicy,
    TorchTrainer,
)
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.protocols.identity import NodeKey
from murmura.server import AggregatorCore, ServerConfig, ServerThread, build_core
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.integration


def vector_spec(n: int) -> ModelSpec:
    return ModelSpec((TensorSpec("w", (n,)),))


def small_core(**cfg) -> AggregatorCore:
    cfg.setdefault("min_clients", 2)
    cfg.setdefault("require_identity", False)  # raw legacy joins; tests/security: identities
    return AggregatorCore(ServerConfig.from_flat(**cfg), vector_spec(4), np.zeros(4, np.float32))


def header(session: str, payload: bytes, **kw) -> UpdateHeader:
    base = dict(session=session, update_id=uuid.uuid4().hex, base_version=0, round=1,
                num_examples=5, codec="dense-f32", payload_bytes=len(payload),
                spec_fingerprint=vector_spec(4).fingerprint())
    base.update(kw)
    return UpdateHeader(**base)


def test_ping_join_pull_push_over_loopback(serve) -> None:
    srv = serve(small_core())
    t = GrpcTransport(srv.address, timeout_s=5)
    a, spec = t.join("a", DeviceProfile())
    b, _ = t.join("b", DeviceProfile())
    assert spec == vector_spec(4) and a.mode == "sync"
    assert t.task(a.session, 0).action.name == "TRAIN"
    version, params = t.pull(a.session)
    assert version == 0 and params.tolist() == [0, 0, 0, 0]
    for s in (a.session, b.session):
        t.task(s, 0)
        payload = np.ones(4, "<f4").tobytes()
        t.push(header(s, payload), payload)
    assert t.pull(a.session)[0] == 1
    assert t.pull(a.session)[1].tolist() == [1, 1, 1, 1]
    t.close()


REFUSALS = [
    ("nan", lambda s: (header(s, NAN), NAN), "INVALID_ARGUMENT", "NaN"),
    ("short payload", lambda s: (header(s, b"\0" * 8), b"\0" * 8), "INVALID_ARGUMENT",
     "does not decode"),
    ("future base", lambda s: (header(s, ONES, base_version=3), ONES), "INVALID_ARGUMENT",
     "future"),
    ("unknown codec", lambda s: (header(s, ONES, codec="gzip"), ONES), "INVALID_ARGUMENT",
     "unknown codec"),
    ("unknown session", lambda s: (header("forged", ONES), ONES), "UNAUTHENTICATED", "Join"),
    ("over limit", lambda s: (header(s, BIG), BIG), "RESOURCE_EXHAUSTED", "exceeds the limit"),
    ("lying length", lambda s: (header(s, ONES, payload_bytes=8), ONES), "INVALID_ARGUMENT",
     "more payload than"),
]
ONES = np.ones(4, "<f4").tobytes()
NAN = np.array([0, np.nan, 0, 0], "<f4").tobytes()
BIG = b"\0" * 4096


@pytest.mark.parametrize("name,make,status,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_carry_a_precise_status_and_leave_the_model_alone(
        serve, name, make, status, message) -> None:
    srv = serve(small_core(max_payload_mb=1024 / (1 << 20)))
    t = GrpcTransport(srv.address, timeout_s=5)
    a, _ = t.join("a", DeviceProfile())
    b, _ = t.join("b", DeviceProfile())
    t.task(a.session, 0), t.task(b.session, 0)
    h, payload = make(a.session)
    with pytest.raises(RemoteError) as err:
        t.push(h, payload)
    assert err.value.status == status and message in err.value.message
    assert t.pull(b.session) == (0, pytest.approx(np.zeros(4)))
    # everyone carries on: both clients complete the round
    for s in (a.session, b.session):
        t.push(header(s, ONES), ONES)
    version, params = t.pull(b.session)
    assert version == 1 and params.tolist() == [1, 1, 1, 1]
    t.close()


def test_malformed_streams_are_refused(serve) -> None:
    srv = serve(small_core())
    with grpc.insecure_channel(srv.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=5)
        stub = pb_grpc.AggregatorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(iter([pb.UpdateChunk(data=b"1234")]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "first chunk" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(iter([]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(pb.JoinRequest(client_id=""), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_plain_generated_stub_interoperates(serve) -> None:
    """Push/Pull frame chunks by hand on our side; a stock protobuf client must not notice."""
    srv = serve(small_core(min_clients=1, mode="async", buffer_size=1))
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.AggregatorStub(ch)
        join = stub.Join(pb.JoinRequest(client_id="stock"), timeout=5, wait_for_ready=True)
        payload = np.full(4, 3.0, "<f4").tobytes()
        chunks = [pb.UpdateChunk(header=pb.UpdateHeader(
            session=join.session, update_id="x", num_examples=1, codec="dense-f32",
            payload_bytes=len(payload), spec_fingerprint=vector_spec(4).fingerprint())),
            pb.UpdateChunk(data=payload[:6]),
            pb.UpdateChunk(data=payload[6:])]
        assert stub.Push(iter(chunks), timeout=5).version == 1
        model = list(stub.Pull(pb.PullRequest(session=join.session), timeout=5))
    assert model[0].header.version == 1
    assert np.frombuffer(b"".join(c.data for c in model[1:]), "<f4").tolist() == [3.0] * 4


def test_a_retried_push_with_the_same_id_counts_once(serve) -> None:
    core = small_core(min_clients=1, mode="async", buffer_size=2)
    srv = serve(core)
    t = GrpcTransport(srv.address, timeout_s=5)
    a, _ = t.join("a", DeviceProfile())
    h = header(a.session, ONES, round=0)
    assert not t.push(h, ONES).duplicate
    assert t.push(h, ONES).duplicate
    assert srv.call(lambda: (core.version, core.traffic.updates)) == (0, 1)
    t.close()


@pytest.mark.parametrize("n_values", [1_500_000, 25_000_000], ids=["6MB", "100MB"])
def test_models_larger_than_a_grpc_message_stream_both_ways(serve, n_values) -> None:
    core = AggregatorCore(ServerConfig.from_flat(mode="async", buffer_size=1, min_clients=1,
                                                 require_identity=False),
                          vector_spec(n_values), np.zeros(n_values, np.float32))
    srv = serve(core)
    t = GrpcTransport(srv.address, timeout_s=60)
    a, spec = t.join("big", DeviceProfile())
    assert spec.nbytes == 4 * n_values
    update = np.full(n_values, 0.5, np.float32)
    update[-1] = 2.0
    payload = update.tobytes()
    t.push(header(a.session, payload, round=0, spec_fingerprint=spec.fingerprint()), payload)
    version, params = t.pull(a.session)
    assert version == 1 and params.shape == (n_values,)
    assert params[0] == 0.5 and params[-1] == 2.0
    t.close()


def digits_clients(srv, task, n, **runtime_kw):
    stats = {}

    def run(i):
        trainer = TorchTrainer(task.build_model(), task.client_data(i, n), device="cpu")
        # seeded keys: the same ids every run, so a sync round folds in the same order
        rt = ClientRuntime(GrpcTransport(srv.address, timeout_s=30), trainer,
                           identity=NodeKey.from_seed(f"client-{i:03d}"), **runtime_kw)
        stats[i] = rt.run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    return threads, stats


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_clients_train_digits_to_high_accuracy(serve, tmp_path, mode) -> None:
    torch.set_num_threads(1)
    tc = TaskConfig()
    cfg = ServerConfig.from_flat(mode=mode, min_clients=4, max_versions=12, buffer_size=3)
    core = build_core(cfg, tc, out_dir=tmp_path)
    srv = serve(core)
    threads, stats = digits_clients(srv, load_task(tc), 4)
    assert srv.wait_done(timeout=120)
    for th in threads:
        th.join(timeout=60)
    acc = srv.call(lambda: core.last_metrics["accuracy"])
    assert acc > 0.8, acc
    assert all(s.refused == 0 for s in stats.values()) or mode == "async"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12


def test_sync_reruns_give_bit_identical_models(serve) -> None:
    torch.set_num_threads(1)
    tc = TaskConfig()
    finals = []
    for _ in range(2):
        core = build_core(ServerConfig.from_flat(min_clients=3, max_versions=3), tc, out_dir=None)
        srv = serve(core)
        threads, _ = digits_clients(srv, load_task(tc), 3)
        assert srv.wait_done(timeout=60)
        for th in threads:
            th.join(timeout=30)
        finals.append(srv.call(lambda c=core: c.params.tobytes()))
    assert finals[0] == finals[1]


def test_client_rides_out_a_server_restart(tmp_path) -> None:
    """The server dies mid-run; a new one resumes from the checkpoint on the same port and the
    client re-joins by itself and finishes."""
    cfg = ServerConfig.from_flat(mode="async", buffer_size=1, min_clients=1, max_versions=6)
    spec = vector_spec(4)
    ckpt = tmp_path / "ckpt.npz"
    first = AggregatorCore(cfg, spec, np.zeros(4, np.float32), checkpoint_path=ckpt)
    srv = ServerThread(first, "127.0.0.1:0").start()
    port = srv.port
    progressed = threading.Event()

    def train(model, settings, seed):
        with torch.no_grad():
            model.w.add_(1.0)
        progressed.set()
        return {"num_examples": 1}

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    rt = ClientRuntime(GrpcTransport(f"127.0.0.1:{port}", timeout_s=5),
                       FunctionTrainer(model, train), wait_s=0.2,
                       retry=RetryPolicy(initial_s=0.05, max_s=0.2, give_up_after_s=60))
    runner = threading.Thread(target=rt.run)
    runner.start()
    try:
        assert progressed.wait(10)
        while srv.call(lambda: first.version) < 2:
            progressed.clear()
            assert progressed.wait(10)
        srv.stop(grace=None)
        from murmura.server import load_checkpoint

        second = AggregatorCore(cfg, spec, np.zeros(4, np.float32), checkpoint_path=ckpt,
                                start=load_checkpoint(ckpt))
        srv = ServerThread(second, f"127.0.0.1:{port}").start()
        assert srv.wait_done(timeout=60)
        runner.join(timeout=30)
        assert not runner.is_alive()
        assert rt.stats.retries + rt.stats.rejoins > 0
        assert srv.call(lambda: second.version) == 6
    finally:
        srv.stop(grace=None)
