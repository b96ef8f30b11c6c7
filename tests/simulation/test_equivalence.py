"""Same config, same seeds: the simulation and real gRPC on loopback give the same model.

Sync policy: the cohort's updates are folded in sorted client-id order, so arrival order does
not matter and the loop path (the deployment's own TorchTrainer) is bit-identical to
``murmura run``. The vectorised path reorders float additions in batched matrix products; it
stays within a relative 1e-5 of the gRPC model after several rounds.

Torch's thread count changes how matrix products are blocked, hence their rounding: the
simulation pins one thread, as ``murmura run``'s client processes do (``client_threads=1``),
and these tests pin one thread for the in-process run too.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from murmura.cli import main
from murmura.client import ClientRuntime, TorchTrainer
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, build_core, load_checkpoint
from murmura.simulation import (
    LocalAggregator,
    SimulationConfig,
    client_id,
    prepare_server,
    simulate,
)
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.integration

CLIENTS, VERSIONS, SEED = 4, 3, 7
TASK = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
SERVER = ServerConfig.from_flat(max_versions=VERSIONS, seed=SEED,
                                train=TaskSettings(local_epochs=1),
                                require_identity=False)  # the simulator runs without identities
COMPARED = ("version", "round", "updates", "updates_in_version", "bytes_up", "bytes_down",
            "accuracy", "loss")


def _grpc_run(out: Path, *extra: str) -> tuple[np.ndarray, list[dict]]:
    """``murmura run`` on loopback gRPC (clients as threads of this process)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["run", "--in-process", "-q", "--no-require-identity",  # as the simulator
                   *extra, "--out", str(out), "--clients", str(CLIENTS),
                   "--max-versions", str(VERSIONS), "--seed", str(SEED), "--local-epochs", "1",
                   "--task", TASK.task, "--model", TASK.model, "--partition", TASK.partition,
                   "--alpha", str(TASK.alpha)])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return load_checkpoint(out / "checkpoint.npz").params, rows


@pytest.fixture(scope="module")
def grpc_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, list[dict]]:
    return _grpc_run(tmp_path_factory.mktemp("grpc"))


def _simulate(tmp_path: Path, server: ServerConfig = SERVER,
              **kw) -> tuple[np.ndarray, list[dict], str]:
    sim = SimulationConfig(clients=CLIENTS, out=str(tmp_path), **kw)
    result = simulate(TASK, server, sim)
    return result.params, result.rows, result.execution_path


@pytest.mark.parametrize("workers,path", [(1, "loop"), (2, "pool")])
def test_sync_simulation_is_bit_identical_to_murmura_run(grpc_run, tmp_path: Path,
                                                         workers: int, path: str) -> None:
    params, rows, ran = _simulate(tmp_path, vectorise="off", workers=workers, speed_spread=10)
    want_params, want_rows = grpc_run
    assert ran == path
    assert params.tobytes() == want_params.tobytes()
    # the metrics agree too, bytes on the wire included; only time differs
    assert [{k: r[k] for k in COMPARED} for r in rows] == \
        [{k: r[k] for k in COMPARED} for r in want_rows]


def test_a_server_decoding_in_worker_processes_gives_the_same_model(grpc_run,
                                                                    tmp_path: Path) -> None:
    # The live run's updates go through the tier's worker processes (shared-memory slabs);
    # the simulation's through its in-process decode: the same pipeline, the same model.
    want_params, want_rows = _grpc_run(tmp_path / "workers", "--workers", "2")
    assert want_rows[-1]["workers"] >= 1 and want_rows[-1]["cold_starts"] >= 1  # they ran
    params, rows, _ = _simulate(tmp_path / "sim", vectorise="off", workers=1)
    assert params.tobytes() == want_params.tobytes() == grpc_run[0].tobytes()
    assert [{k: r[k] for k in COMPARED} for r in rows] == \
        [{k: r[k] for k in COMPARED} for r in want_rows]


@pytest.mark.slow
def test_evaluation_on_the_clients_matches_murmura_run(tmp_path: Path) -> None:
    # Every second version the clients measure the global model on a held-out part of their
    # share and train on the rest: the same split, the same figures, the same model.
    want_params, want_rows = _grpc_run(tmp_path / "grpc", "--client-eval-every", "2")
    server = dataclasses.replace(SERVER, train=TaskSettings(local_epochs=1,
                                                            client_eval_every=2))
    params, rows, _ = _simulate(tmp_path / "sim", server, vectorise="off", workers=1)
    evals = [{k: v for k, v in r.items() if k.startswith("client_eval")} for r in rows]
    assert [e.get("client_eval_clients") for e in evals] == [CLIENTS, None, CLIENTS]
    assert evals == [{k: v for k, v in r.items() if k.startswith("client_eval")}
                     for r in want_rows]
    assert params.tobytes() == want_params.tobytes()
    # the held-out examples are no longer trained on: the model differs from the run without
    plain = _simulate(tmp_path / "plain", vectorise="off", workers=1)[0]
    assert params.tobytes() != plain.tobytes()


def test_vectorised_simulation_matches_murmura_run_within_float_rounding(
        grpc_run, tmp_path: Path) -> None:
    params, rows, ran = _simulate(tmp_path, vectorise="on")
    want_params, want_rows = grpc_run
    assert ran == "vmap"
    err = np.abs(params - want_params).max() / np.abs(want_params).max()
    assert err < 1e-5
    assert [r["bytes_up"] for r in rows] == [r["bytes_up"] for r in want_rows]
    assert rows[-1]["accuracy"] == pytest.approx(want_rows[-1]["accuracy"], abs=0.01)


def test_client_runtime_over_the_in_memory_transport_matches_too(grpc_run) -> None:
    # Prepare: the deployment's ClientRuntime, unchanged, one thread per client
    server = prepare_server(SERVER, SimulationConfig(clients=CLIENTS))
    core = build_core(server, TASK, out_dir=None)
    hub = LocalAggregator(core)
    task = load_task(TASK)
    stats = []

    def client(i: int) -> None:
        trainer = TorchTrainer(task.build_model(), task.client_data(i, CLIENTS), device="cpu")
        runtime = ClientRuntime(hub.transport(), trainer, client_id=client_id(i), wait_s=5.0)
        stats.append(runtime.run())

    # Execute
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Assert
    assert core.version == VERSIONS and len(stats) == CLIENTS
    assert core.params.tobytes() == grpc_run[0].tobytes()
    assert core.traffic.bytes_up == grpc_run[1][-1]["bytes_up"]
    assert core.traffic.bytes_down == grpc_run[1][-1]["bytes_down"]
