"""An app's own ``train`` in the simulator: each virtual client runs it on the deployed client's
own ``client_data``, so a sync simulation ends with ``murmura run``'s model, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from murmura.cli import main
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, load_checkpoint
from murmura.simulation import SimulationConfig, simulate
from murmura.tasks import TaskConfig
from tests.tasks.app_fixture import write_app

CLIENTS, VERSIONS, SEED = 3, 2, 4


@pytest.mark.integration
def test_a_simulation_runs_the_apps_own_train_as_murmura_run_does(tmp_path: Path) -> None:
    app = write_app(tmp_path, "sim_train_app")
    rc = main(["run", "--in-process", "-q", "--no-require-identity", "--app", str(app),
               "--out", str(tmp_path / "grpc"), "--clients", str(CLIENTS),
               "--max-versions", str(VERSIONS), "--seed", str(SEED), "--local-epochs", "1",
               "--batch-size", "16", "--lr", "0.05"])
    assert rc == 0
    want = load_checkpoint(tmp_path / "grpc" / "checkpoint.npz").params

    server = ServerConfig.from_flat(max_versions=VERSIONS, seed=SEED, require_identity=False,
                                    train=TaskSettings(local_epochs=1, batch_size=16, lr=0.05))
    for workers in (1, 2):
        result = simulate(TaskConfig(app=str(app)), server,
                          SimulationConfig(clients=CLIENTS, workers=workers), out_dir=None)
        assert result.execution_path == ("loop" if workers == 1 else "pool")
        assert result.params.tobytes() == want.tobytes()


def test_an_apps_own_train_is_not_vectorised(tmp_path: Path) -> None:
    app = write_app(tmp_path, "sim_train_app_vmap", suffix="vmap")
    server = ServerConfig.from_flat(max_versions=1, require_identity=False)
    with pytest.raises(ValueError, match="own train"):
        simulate(TaskConfig(app=str(app)), server,
                 SimulationConfig(clients=2, vectorise="on"), out_dir=None)


LOSS_APP = '''
import numpy as np
import torch
from torch import nn


def model():
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))


def client_data(index, num_clients):
    rng = np.random.default_rng(10 + index)
    y = rng.integers(0, 2, 96)
    x = rng.normal(0, 1.0, (96, 2)) + np.where(y[:, None] == 1, 1.0, -1.0)
    return x.astype(np.float32), y.astype(np.int64)


def loss(logits, y):
    return nn.functional.cross_entropy(logits, y, label_smoothing=0.2)
'''


@pytest.mark.integration
def test_a_simulation_minimises_the_apps_own_loss_as_murmura_run_does(tmp_path: Path) -> None:
    app = tmp_path / "loss_app.py"
    app.write_text(LOSS_APP, encoding="utf-8")
    rc = main(["run", "--in-process", "-q", "--no-require-identity", "--app", str(app),
               "--out", str(tmp_path / "grpc"), "--clients", str(CLIENTS),
               "--max-versions", str(VERSIONS), "--seed", str(SEED), "--local-epochs", "1",
               "--batch-size", "16", "--lr", "0.05"])
    assert rc == 0
    want = load_checkpoint(tmp_path / "grpc" / "checkpoint.npz").params
    server = ServerConfig.from_flat(max_versions=VERSIONS, seed=SEED, require_identity=False,
                                    train=TaskSettings(local_epochs=1, batch_size=16, lr=0.05))
    result = simulate(TaskConfig(app=str(app)), server,
                      SimulationConfig(clients=CLIENTS, workers=1), out_dir=None)
    assert result.execution_path == "loop"
    assert result.params.tobytes() == want.tobytes()
