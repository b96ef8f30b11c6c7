"""Murmura's rules as Flower strategies, inside a real Flower simulation (flwr's
``run_simulation`` on its Ray backend).

One simulation runs every scenario in turn from one ServerApp (starting Ray is the slow part):
each strategy's final global model is compared with the true weights of tests/flower/sim_apps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray", reason="Flower's simulation runs on Ray (dev extra)")

from flwr.app import ArrayRecord, ConfigRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from murmura.server.flower import (  # noqa: E402
    MurmuraStrategy,
    RobustStrategy,
    StalenessStrategy,
    SybilStrategy,
)
from tests.flower import sim_apps  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]

NODES = 6
ROUNDS = 4


def _strategies() -> list[tuple[str, Any, dict[str, int]]]:
    every = {"fraction_evaluate": 0.0, "min_train_nodes": NODES, "min_available_nodes": NODES}
    return [
        # one Byzantine node adds 100 to every weight
        ("fedavg-byzantine", FedAvg(**every), {"byzantine": 1}),
        ("default-byzantine", RobustStrategy("default", **every), {"byzantine": 1}),
        ("median-byzantine", RobustStrategy("median", **every), {"byzantine": 1}),
        ("trimmed-byzantine", RobustStrategy("trimmed-mean", {"trim": 0.2}, **every),
         {"byzantine": 1}),
        # three clones push towards -W_TRUE; three honest nodes on disjoint features
        ("fedavg-sybil", MurmuraStrategy("fedavg", **every), {"sybils": 3}),
        ("sybil-sybil", SybilStrategy(**every), {"sybils": 3}),
        # node 0 keeps training from the first global model
        ("fedavg-stale", MurmuraStrategy("fedavg", **every), {"stale": 1}),
        ("staleness-stale", StalenessStrategy("polynomial", {"a": 1.0}, **every),
         {"stale": 1}),
        # nobody misbehaves: the robust default still learns
        ("default-clean", RobustStrategy("default", **every), {}),
    ]


@pytest.fixture(scope="module")
def outcome() -> dict[str, Any]:
    results: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name, strategy, scenario in _strategies():
            result = strategy.start(
                grid=grid, initial_arrays=ArrayRecord([np.zeros(sim_apps.DIM, np.float32)]),
                num_rounds=ROUNDS, train_config=ConfigRecord({"tag": name, **scenario}))
            w = result.arrays.to_numpy_ndarrays()[0]
            results[name] = {"error": float(np.linalg.norm(w - sim_apps.W_TRUE)),
                             "strategy": strategy}

    run_simulation(server_app=server, client_app=sim_apps.app, num_supernodes=NODES,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "num_gpus": 0,
                                                 "include_dashboard": False}})
    missing = {name for name, _, _ in _strategies()} - set(results)
    assert not missing, f"the simulation did not finish {sorted(missing)}"
    return results


START = float(np.linalg.norm(sim_apps.W_TRUE))  # the error of the zero initial model


def test_robust_rules_resist_a_byzantine_node_that_fedavg_follows(outcome: dict[str, Any]
                                                                    ) -> None:
    assert outcome["fedavg-byzantine"]["error"] > 10 * START  # pulled far away
    for name in ("default-byzantine", "median-byzantine", "trimmed-byzantine"):
        assert outcome[name]["error"] < 0.5 * START, (name, outcome[name]["error"])


def test_sybil_weighting_ignores_clones_that_steer_fedavg(outcome: dict[str, Any]) -> None:
    assert outcome["fedavg-sybil"]["error"] > START  # clones drag the model to -W_TRUE
    assert outcome["sybil-sybil"]["error"] < 0.5 * START
    scorer = outcome["sybil-sybil"]["strategy"].rule
    weights = dict(zip(scorer.last_ids, scorer.last_weights, strict=True))
    assert len(weights) == NODES


def test_staleness_weighting_discounts_a_stale_node(outcome: dict[str, Any]) -> None:
    stale = outcome["staleness-stale"]
    factors = sorted(stale["strategy"].last_factors.values())
    assert factors[0] == pytest.approx(1 / ROUNDS)  # tau = ROUNDS - 1 in the last round
    assert factors[1:] == [1.0] * (NODES - 1)
    assert stale["error"] < outcome["fedavg-stale"]["error"]


def test_robust_default_learns_without_attackers(outcome: dict[str, Any]) -> None:
    assert outcome["default-clean"]["error"] < 0.2 * START
