"""Murmura's robust aggregation inside a plain Flower app (Message API, flwr 1.41).

The ClientApp trains examples/flower_client.py's DigitsClient; one of the supernodes is
Byzantine (it adds ``--attack`` to every weight). The ServerApp runs Murmura's
``RobustStrategy`` where a Flower app would run ``FedAvg``:

    python examples/flower_strategy.py                  # Murmura's default robust rule
    python examples/flower_strategy.py --rule median    # or any rule Murmura registers
    python examples/flower_strategy.py --rule flower-fedavg   # Flower's FedAvg, for contrast

Flower's simulation runs on Ray (``pip install "flwr[simulation]"``; Murmura's dev extra has it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flower_client import DigitsClient  # noqa: E402

from murmura.server.flower import RobustStrategy  # noqa: E402

NODES = 5
client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    client = DigitsClient(pid, int(context.node_config["num-partitions"]))
    config = msg.content["config"]
    arrays, n, metrics = client.fit(msg.content["arrays"].to_numpy_ndarrays(), dict(config))
    if pid == 0 and float(config.get("attack", 0.0)):  # the Byzantine node
        arrays = [a + np.float32(config["attack"]) for a in arrays]
    return Message(RecordDict({"arrays": ArrayRecord(arrays),
                               "metrics": MetricRecord({"num-examples": n, **metrics})}),
                   reply_to=msg)


def make_server_app(rule: str, rounds: int, attack: float) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        common: dict[str, Any] = {"fraction_evaluate": 0.0, "min_train_nodes": NODES,
                                  "min_available_nodes": NODES}
        strategy = FedAvg(**common) if rule == "flower-fedavg" else RobustStrategy(rule, **common)
        judge = DigitsClient()

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            loss, _, metrics = judge.evaluate(arrays.to_numpy_ndarrays(), {})
            print(f"round {server_round}: accuracy {metrics['accuracy']:.3f}", flush=True)
            return MetricRecord({"loss": loss, **metrics})

        strategy.start(grid=grid, initial_arrays=ArrayRecord(judge.get_parameters({})),
                       num_rounds=rounds, evaluate_fn=evaluate,
                       train_config=ConfigRecord({"lr": 0.1, "local_epochs": 1,
                                                  "batch_size": 32, "attack": attack}))
    return app


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rule", default="default",
                   help="a Murmura rule (default, median, trimmed-mean, krum, ...) or "
                   "flower-fedavg (default: default)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attack", type=float, default=50.0,
                   help="what the Byzantine node adds to every weight (0: none)")
    args = p.parse_args()
    run_simulation(server_app=make_server_app(args.rule, args.rounds, args.attack),
                   client_app=client_app, num_supernodes=NODES,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
