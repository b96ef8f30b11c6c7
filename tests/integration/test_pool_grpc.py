"""Seed-pool runs over real gRPC on loopback: clients catch up from K scalars, not the model."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from murmura.client import ClientRuntime, GrpcTransport, RemoteError
from murmura.client.zo import make_trainer
from murmura.protocols import DeviceProfile, TaskSettings
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols import murmura_pb2_grpc as pb_grpc
from murmura.protocols.codecs.seed import pool_model
from murmura.protocols.pool import seed_pool_for
from murmura.server import ServerConfig, ServerThread, build_core
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.integration

K = 128
SETTINGS = TaskSettings(trainer="zo", codec="seed", codec_options={"pool": str(K)},
                        local_epochs=0, local_steps=40, batch_size=32, lr=8e-3, seed=3)


@pytest.fixture
def pool_server(tmp_path):
    torch.set_num_threads(1)
    core = build_core(ServerConfig.from_flat(mode="sync", min_clients=2, max_versions=3,
                                             train=SETTINGS, require_identity=False),
                      TaskConfig(), out_dir=tmp_path)
    srv = ServerThread(core, "127.0.0.1:0").start()
    yield core, srv
    srv.stop(grace=None)


def test_pool_clients_train_and_a_newcomer_rebuilds_the_model_from_k_scalars(pool_server
                                                                            ) -> None:
    # Prepare: two zeroth-order clients with the trainer `murmura client` uses
    core, srv = pool_server
    task = load_task(TaskConfig())
    transports = [GrpcTransport(srv.address, timeout_s=30) for _ in range(2)]

    def run(i: int) -> None:
        trainer = make_trainer(task.build_model(), task.client_data(i, 2), device="cpu")
        ClientRuntime(transports[i], trainer, client_id=f"zo-{i}").run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    assert srv.wait_done(timeout=120)
    for th in threads:
        th.join(timeout=30)

    # Execute: a newcomer pulls the base once and the scalars
    newcomer = GrpcTransport(srv.address, timeout_s=30)
    result, _ = newcomer.join("newcomer", DeviceProfile())
    base_version, base = newcomer.pull_pool_base(result.session)
    before = newcomer.bytes_down
    version, scalar_base, scalars = newcomer.pull_pool_scalars(result.session)
    scalar_bytes = newcomer.bytes_down - before
    _, model = newcomer.pull(result.session)
    newcomer.close()

    # Assert: every client download after the first base pull was K scalars; exact rebuild
    pool = seed_pool_for(SETTINGS)
    assert pool is not None
    assert version == 3 and base_version == scalar_base == 0
    assert scalars.shape == (K,) and scalars.dtype == np.float32 and scalars.any()
    assert 4 * K <= scalar_bytes <= 4 * K + 32
    assert np.array_equal(pool_model(base, pool, scalars), model)
    assert model.tobytes() == srv.call(lambda: core.params.tobytes())
    # one base (model plus a header with the spec) and three rounds of scalars, where pulling
    # the model every round would have cost three models
    per_client = [t.bytes_down for t in transports]
    assert all(d < 4 * base.size + 512 + 3 * (4 * K + 32) for d in per_client), per_client


def test_pool_pulls_are_refused_in_a_run_without_a_pool_and_unknown_kinds(tmp_path) -> None:
    core = build_core(ServerConfig.from_flat(min_clients=1, max_versions=1,
                                             require_identity=False), TaskConfig(), out_dir=None)
    srv = ServerThread(core, "127.0.0.1:0").start()
    try:
        transport = GrpcTransport(srv.address, timeout_s=10)
        session = transport.join("c", DeviceProfile())[0].session
        with pytest.raises(RemoteError) as info:
            transport.pull_pool_scalars(session)
        assert info.value.status == "FAILED_PRECONDITION"
        transport.close()
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.AggregatorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Pull(pb.PullRequest(session=session, kind=7), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown pull kind" in err.value.details()
    finally:
        srv.stop(grace=None)
