"""What a Flower app says besides its train handler: its ``@app.query()`` handler (or a
NumPyClient's ``get_properties``), its ServerApp's strategy settings (``fraction-train``...),
and its evaluate handler on the clients of ``murmura simulate`` (``--client-eval-every``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from murmura.cli import main
from murmura.client import ClientConfig
from murmura.client.flower import FlowerTrainer, _ClientAppDriver
from murmura.client.flower_app import server_app_settings
from murmura.client.flower_load import (
    _context,
    app_run_config,
    load_flower_client,
    profile_extra,
    query_properties,
    run_flower_client,
)
from murmura.client.flower_message import MessageAppTrainer
from murmura.clients import flower_server_settings
from murmura.server import ServerConfig
from murmura.server.limits import check_profile

PKG = "murmura_tiny_flower_app"

SERVER_APP = """
import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid, context):
    FedAvg(fraction_train=context.run_config["fraction-train"]).start(
        grid=grid, initial_arrays=ArrayRecord([np.zeros(3, np.float32)]),
        num_rounds=context.run_config["num-server-rounds"])
"""

CLIENT_APP = """
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg, context):
    pid = context.node_config["partition-id"]
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    # each client's own step (a server refuses a payload another client already sent)
    return Message(RecordDict({"arrays": ArrayRecord([w + 1 + 0.001 * pid]),
                               "metrics": MetricRecord({"num-examples": 4 + pid})}),
                   reply_to=msg)


@app.evaluate()
def evaluate(msg, context):
    pid = context.node_config["partition-id"]
    n = context.node_config["num-partitions"]
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    acc = 0.1 * float(w[0]) + 0.01 * pid if n > 1 else 0.1 * float(w[0])
    return Message(RecordDict({"metrics": MetricRecord({"eval_acc": acc, "eval_loss": 1.0,
                                                        "num-examples": 10})}),
                   reply_to=msg)


@app.query()
def query(msg, context):
    pid = context.node_config["partition-id"]
    asked = msg.content["config"]["query"]
    return Message(RecordDict({"props": ConfigRecord({"name": f"node-{pid}", "gpu": False,
                                                      "asked": asked}),
                               "numbers": MetricRecord({"partition": pid, "ram-gb": 1.5})}),
                   reply_to=msg)
"""

CONFIG = """num-server-rounds = 2
fraction-train = 0.5
fraction-evaluate = 0.5
min-available-nodes = 3
"""


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Flower app with train, evaluate and query handlers and a FedAvg ServerApp whose run
    config holds strategy settings (numpy only: every run takes a second)."""
    app = tmp_path_factory.mktemp("apps") / "tiny-app"
    (app / PKG).mkdir(parents=True)
    (app / PKG / "__init__.py").write_text("")
    (app / PKG / "server_app.py").write_text(SERVER_APP)
    (app / PKG / "client_app.py").write_text(CLIENT_APP)
    (app / "pyproject.toml").write_text(
        f'[tool.flwr.app.components]\nserverapp = "{PKG}.server_app:app"\n'
        f'clientapp = "{PKG}.client_app:app"\n\n[tool.flwr.app.config]\n{CONFIG}')
    return app


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- query handlers --------------------------------------------------------------------------

def test_the_query_handler_gives_the_clients_properties(tiny_app: Path) -> None:
    trainer = load_flower_client(str(tiny_app), client_index=1, num_clients=3)
    assert isinstance(trainer, MessageAppTrainer) and trainer.has_query
    assert trainer.query() == {"name": "node-1", "gpu": False, "asked": "properties",
                               "partition": 1, "ram-gb": 1.5}


def test_properties_ride_on_the_join_profile_and_are_logged(
        tiny_app: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import murmura.client.runtime as runtime

    seen: dict[str, Any] = {}

    class Runtime:
        def __init__(self, transport: Any, trainer: Any, **kw: Any) -> None:
            seen.update(kw)
            self.client_id = "fake"

        def run(self, max_tasks: int = 0) -> runtime.ClientStats:
            return runtime.ClientStats()

    monkeypatch.setattr(runtime, "ClientRuntime", Runtime)
    with caplog.at_level(logging.INFO, logger="murmura.client.flower_load"):
        run_flower_client(ClientConfig(server="127.0.0.1:1", client_index=2, num_clients=4),
                          str(tiny_app))
    extra = seen["profile"].extra
    assert extra == {"flwr.asked": "properties", "flwr.gpu": "false", "flwr.name": "node-2",
                     "flwr.partition": "2", "flwr.ram-gb": "1.5"}
    check_profile(seen["profile"])  # within what a server accepts at Join
    assert any("Flower client 2 properties (its query handler): asked='properties', "
               "gpu=False, name='node-2', partition=2, ram-gb=1.5" in r.getMessage()
               for r in caplog.records)


def test_profile_entries_stay_within_the_servers_limits() -> None:
    props: dict[str, Any] = {f"k{i:02d}": i for i in range(20)}
    props["k00"] = "x" * 300 + "\n"
    extra = profile_extra(props)
    assert len(extra) == 12 and extra["flwr.k00"] == "x" * 256
    check_profile(__import__("murmura.protocols", fromlist=["DeviceProfile"]).DeviceProfile(
        extra={**extra, "torch": "2", "python": "3"}))


def test_a_failing_query_handler_is_a_warning_not_a_stop(
        caplog: pytest.LogCaptureFixture) -> None:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return msg

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"x": ConfigRecord({"v": msg.content["config"]["nope"]})}),
                       reply_to=msg)

    from flwr.app import Array, ArrayRecord

    trainer = MessageAppTrainer(app, _context(0, 1), ArrayRecord({"w": Array(np.zeros(2))}),
                                name="ClientApp q")
    with caplog.at_level(logging.WARNING):
        assert query_properties(trainer, "client 0") == {}
    assert "client 0: asking the app for its properties failed (ignored): ClientApp q's " \
           "query handler failed: KeyError" in caplog.text
    no_query = MessageAppTrainer(_app_without_query(), _context(0, 1),
                                 ArrayRecord({"w": Array(np.zeros(2))}))
    assert no_query.query() is None and query_properties(no_query) == {}


def _app_without_query() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return msg

    return app


class Props(NumPyClient):
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [np.zeros(2, np.float32)]

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        return {"asked": config["query"], "cores": 8, "blob": b"raw"}

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        return parameters, 1, {}


class NoProps(Props):
    get_properties = NumPyClient.get_properties  # as a client that never wrote one


def test_a_numpy_clients_get_properties_is_asked_in_every_form() -> None:
    assert FlowerTrainer.from_client(Props()).query() == {"asked": "properties", "cores": 8}
    assert FlowerTrainer.from_client(NoProps()).query() is None
    for client, want in ((Props(), {"asked": "properties", "cores": 8}), (NoProps(), None)):
        trainer = FlowerTrainer(_ClientAppDriver(_legacy_app(client), _context(0, 1)))
        assert trainer.query() == want


def _legacy_app(client: NumPyClient) -> ClientApp:
    """``ClientApp(client_fn=...)``, the older form."""
    def client_fn(context: Context) -> Any:
        return client.to_client()

    return ClientApp(client_fn=client_fn)


# -- the ServerApp's strategy settings -------------------------------------------------------

def test_fraction_train_maps_to_the_cohort_and_the_rest_is_named() -> None:
    config = {"num-server-rounds": 3, "fraction-train": 0.5, "fraction-evaluate": 0.2,
              "min-available-nodes": 4, "lr": 0.1, "my-own-key": 1}
    sync = server_app_settings(config, mode="sync")
    assert sync.settings == {"cohort_fraction": 0.5}
    assert sync.notice == (
        "the Flower app's ServerApp settings: applied fraction-train=0.5 -> --cohort-fraction "
        "0.5; ignored, as Murmura runs its own server loop: fraction-evaluate=0.2 (the server "
        "evaluates every version with the app's evaluate handler; --client-eval-every N has "
        "the clients evaluate too); min-available-nodes=4 (--min-clients)")
    given = server_app_settings(config, mode="sync", given={"cohort_size"})
    assert given.settings == {} and "fraction-train=0.5 (--cohort-fraction/--cohort-size " \
                                     "given)" in given.notice
    asynchronous = server_app_settings({"fraction-fit": 0.3}, mode="async")
    assert asynchronous.settings == {} and "fraction-fit=0.3 (mode async has no rounds" in \
        asynchronous.notice
    assert server_app_settings({"fraction-train": 2}, mode="sync").settings == {}
    assert server_app_settings({"num-server-rounds": 3, "lr": 0.1}, mode="sync").notice == ""


def test_servers_take_the_apps_fraction_train_unless_given(
        tiny_app: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert app_run_config(str(tiny_app), "num-server-rounds=5")["num-server-rounds"] == 5
    assert app_run_config(f"{tiny_app / PKG / 'client_app.py'}:app")["fraction-train"] == 0.5
    with caplog.at_level(logging.WARNING, logger="murmura"):
        server = flower_server_settings(ServerConfig(), str(tiny_app), None, set())
    assert server.policy.cohort_fraction == 0.5
    assert "min-available-nodes=3 (--min-clients)" in caplog.text
    kept = flower_server_settings(ServerConfig.from_flat(cohort_fraction=0.25), str(tiny_app),
                                  None, {"cohort_fraction"})
    assert kept.policy.cohort_fraction == 0.25
    asynchronous = flower_server_settings(ServerConfig(mode="async"), str(tiny_app), None,
                                          set())
    assert asynchronous.policy.cohort_fraction == 1.0


@pytest.mark.integration
def test_murmura_run_samples_the_apps_fraction_of_clients(tiny_app: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["run", "--flower-app", str(tiny_app), "--clients", "4", "--in-process",
                 "--out", str(out), "-q", "--timeout-s", "120"]) == 0
    rows = [r for r in _rows(out) if r["version"] > 0]
    assert [r["client_train_updates"] for r in rows] == [2, 2]  # fraction-train 0.5 of 4


# -- murmura simulate: client evaluation, properties, fraction-train -------------------------

def test_simulate_runs_the_evaluate_handler_on_clients_and_records_properties(
        tiny_app: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "sim"
    with caplog.at_level(logging.WARNING, logger="murmura.simulation.flower"):
        assert main(["simulate", "--flower-app", str(tiny_app), "--clients", "4",
                     "--executor", "loop", "--client-eval-every", "1", "--out", str(out),
                     "-q"]) == 0
    assert "applied fraction-train=0.5 -> --cohort-fraction 0.5" in caplog.text
    assert "fraction-evaluate=0.5 (the server evaluates every version" in caplog.text
    rows = _rows(out)
    assert [r["version"] for r in rows][-1] == 2
    for r in rows[1:]:
        assert r["client_train_updates"] == 2  # fraction-train 0.5 of 4 clients
        assert r["client_eval_reports"] == 2  # each cohort member evaluated the global model
        assert r["client_eval_versions"] == [r["version"] - 1, r["version"] - 1]
        # eval_acc = 0.1 * w + 0.01 * partition; the global w is about the version number
        assert 0.1 * (r["version"] - 1) <= r["client_acc_mean"] <= 0.1 * (r["version"] - 1) + 0.04
        assert r["client_loss_mean"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    props = summary["simulation"]["flower_properties"]
    assert props and set(props) <= {f"client-{i:03d}" for i in range(4)}
    for cid, p in props.items():
        assert p == {"name": f"node-{int(cid[-3:])}", "gpu": False, "asked": "properties",
                     "partition": int(cid[-3:]), "ram-gb": 1.5}


def test_simulate_keeps_a_given_cohort_and_the_pool_reports_properties(
        tiny_app: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--flower-app", str(tiny_app), "--clients", "4",
                 "--executor", "pool", "--workers", "2", "--cohort-fraction", "1",
                 "--out", str(out), "-q"]) == 0
    rows = _rows(out)
    assert all(r["client_train_updates"] == 4 for r in rows[1:])
    assert "client_eval_reports" not in rows[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["simulation"]["flower_properties"]) == \
        [f"client-{i:03d}" for i in range(4)]
