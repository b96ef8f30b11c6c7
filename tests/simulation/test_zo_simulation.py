"""Seed-based zeroth-order training in the simulator: each virtual client runs the client's own
ZOTrainer and pushes the step log it returns, so a sync simulation ends with the model
``murmura run`` (real gRPC clients on loopback) ends with, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from murmura.cli import main
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, load_checkpoint
from murmura.simulation import SimulationConfig, simulate
from murmura.tasks import TaskConfig

CLIENTS, VERSIONS, SEED, STEPS = 3, 3, 5, 20
TASK = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
ZO = TaskSettings(trainer="zo", codec="seed", local_epochs=0, local_steps=STEPS, lr=1e-3,
                  batch_size=16, zo_eps=1e-3)
SERVER = ServerConfig.from_flat(max_versions=VERSIONS, seed=SEED, train=ZO, require_identity=False)


@pytest.mark.integration
def test_a_zeroth_order_simulation_matches_murmura_run(tmp_path: Path) -> None:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["run", "--in-process", "-q", "--no-require-identity",
                   "--out", str(tmp_path / "grpc"), "--clients", str(CLIENTS),
                   "--max-versions", str(VERSIONS), "--seed", str(SEED),
                   "--trainer", "zo", "--codec", "seed", "--local-epochs", "0",
                   "--local-steps", str(STEPS), "--lr", "0.001", "--batch-size", "16",
                   "--zo-eps", "0.001", "--task", TASK.task, "--model", TASK.model,
                   "--partition", TASK.partition, "--alpha", str(TASK.alpha)])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    want = load_checkpoint(tmp_path / "grpc" / "checkpoint.npz").params
    want_rows = [json.loads(line)
                 for line in (tmp_path / "grpc" / "metrics.jsonl").read_text().splitlines()]

    result = simulate(TASK, SERVER, SimulationConfig(clients=CLIENTS, out=str(tmp_path / "sim"),
                                                     vectorise="auto", workers=1))
    assert result.execution_path == "loop"
    assert result.params.tobytes() == want.tobytes()
    assert [r["bytes_up"] for r in result.rows] == [r["bytes_up"] for r in want_rows]
    # a seed update is a few bytes per step, whatever the model size
    per_update = result.rows[0]["bytes_up"] / result.rows[0]["updates"]
    assert per_update < 40 * STEPS + 400


def test_zeroth_order_simulation_refuses_paths_it_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="zeroth-order trainer runs in the loop, pool or vmap"):
        simulate(TASK, SERVER, SimulationConfig(clients=2, executor="ray", out=None),
                 out_dir=None)


def test_a_zeroth_order_simulation_learns(tmp_path: Path) -> None:
    server = ServerConfig.from_flat(max_versions=6, seed=1, require_identity=False,
                                    train=TaskSettings(trainer="zo", codec="seed", local_epochs=0,
                                             local_steps=50, lr=2e-3, batch_size=32))
    result = simulate(TASK, server, SimulationConfig(clients=4, workers=1), out_dir=None)
    losses = [r["loss"] for r in result.rows]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert np.isfinite(result.params).all()


def test_update_attacks_are_refused_in_a_zeroth_order_simulation() -> None:
    from murmura.client.malicious import make_attack
    from murmura.simulation import Simulation

    with pytest.raises(ValueError, match="zeroth-order"):
        Simulation(TASK, SERVER, SimulationConfig(clients=2), out_dir=None,
                   attacks={0: make_attack("sign-flip", {}, seed=0)})
