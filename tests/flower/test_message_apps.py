"""Flower apps as they are written today (Message-API ClientApps, ``flwr new``'s templates in
tests/flower/apps/) run unchanged on Murmura: the adapter, bad apps, and real runs
(``murmura run`` over loopback gRPC, ``murmura simulate``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from murmura.cli import main
from murmura.client.flower import FlowerTrainer
from murmura.client.flower_app import FlowerAppError, parse_run_config
from murmura.client.flower_load import app_defaults, load_flower_client
from murmura.client.flower_message import MessageAppTrainer
from murmura.protocols import TaskSettings

APPS = Path(__file__).resolve().parent / "apps"
TORCH_APP = APPS / "quickstart-pytorch"
NUMPY_APP = APPS / "quickstart-numpy"


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- the adapter --------------------------------------------------------------------------

def test_the_numpy_template_trains_with_its_serverapps_model_and_run_config() -> None:
    trainer = load_flower_client(str(NUMPY_APP), client_index=1, num_clients=4,
                                 run_config_overrides="num-server-rounds=5 note=hi")
    assert isinstance(trainer, MessageAppTrainer)
    assert [(t.name, t.shape, t.dtype) for t in trainer.spec.tensors] == \
        [("0", (1, 1), "float64")]  # the ServerApp's get_dummy_model()
    assert trainer.context.node_config == {"partition-id": 1, "num-partitions": 4}
    assert trainer.run_config == {"num-server-rounds": 5, "note": "hi"}
    assert trainer.app_defaults == {"max_versions": 5}
    start = trainer.initial()
    trainer.on_pull(0)
    result = trainer.train(start, TaskSettings(), seed=3)
    assert result.num_examples == 1 and set(result.metrics) == {"random_metric"}
    assert result.params is not None and 1.0 <= float(result.params[0]) <= 2.0  # + U(0, 1)
    again = trainer.train(start, TaskSettings(), seed=3)
    assert again.params is not None and again.params[0] == result.params[0]  # seeded


def test_the_pytorch_template_gets_state_dict_keys_config_and_evaluates() -> None:
    trainer = load_flower_client(f"{TORCH_APP}/quickstart_pytorch/client_app.py:app",
                                 client_index=0, num_clients=3)
    assert isinstance(trainer, MessageAppTrainer)
    assert [t.name for t in trainer.spec.tensors][:2] == ["conv1.weight", "conv1.bias"]
    assert trainer.train_config == {"lr": 0.01}  # the ServerApp's train ConfigRecord
    assert trainer.app_defaults == {"lr": 0.01, "local_epochs": 1, "max_versions": 3}
    evaluate = trainer.evaluator()
    before = evaluate(trainer.initial())
    assert {"eval_loss", "eval_acc", "accuracy", "loss"} <= set(before)
    trainer.on_pull(0)
    result = trainer.train(trainer.initial(), TaskSettings(lr=0.01, client_eval_every=1),
                           seed=1)
    assert result.num_examples == 640 and result.metrics["train_loss"] > 0
    assert result.metrics["eval_version"] == 0 and result.metrics["eval_examples"] == 160
    assert "eval_acc" in result.metrics  # the handler's own name, evaluated before training
    assert result.params is not None and evaluate(result.params)["loss"] < before["loss"]


def test_run_config_values_parse_as_flower_does() -> None:
    assert parse_run_config('a=1 b=0.5 c=true d="x y" e=word') == \
        {"a": 1, "b": 0.5, "c": True, "d": "x y", "e": "word"}
    with pytest.raises(FlowerAppError, match="KEY=VALUE"):
        parse_run_config("novalue")
    assert app_defaults({"lr": 0.1, "local-epochs": 2}, {"lr": 0.3}) == \
        {"lr": 0.3, "local_epochs": 2}


# -- bad apps: one clear line naming the app and what is wrong ------------------------------

def _app(reply: Any) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(content=reply(msg), reply_to=msg)

    return app


def _trainer(app: ClientApp) -> MessageAppTrainer:
    context = Context(run_id=0, node_id=1, node_config={}, state=RecordDict(), run_config={})
    initial = ArrayRecord({"w": _array(np.zeros((2, 3), np.float32)),
                           "n": _array(np.array([4], np.int64))})
    return MessageAppTrainer(app, context, initial, name="ClientApp bad")


def _array(a: np.ndarray) -> Any:
    from flwr.app import Array

    return Array(a)


@pytest.mark.parametrize(("reply", "message"), [
    (lambda m: RecordDict({"metrics": MetricRecord({"num-examples": 3})}),
     "ClientApp bad's train handler replied with no ArrayRecord"),
    (lambda m: RecordDict({"arrays": m.content["arrays"], "metrics": MetricRecord({"x": 1.0})}),
     "ClientApp bad's train handler replied with no 'num-examples'"),
    (lambda m: RecordDict({"arrays": ArrayRecord({"w": _array(np.zeros((3, 2), np.float32))}),
                           "metrics": MetricRecord({"num-examples": 3})}),
     r"ClientApp bad: the train handler's reply has array 'w' of shape \(3, 2\); expected "
     r"\(2, 3\)"),
    (lambda m: 1 / 0, "ClientApp bad's train handler failed: ZeroDivisionError"),
])
def test_a_bad_reply_is_a_one_line_error(reply: Any, message: str) -> None:
    trainer = _trainer(_app(reply))
    with pytest.raises(FlowerAppError, match=message):
        trainer.train(trainer.initial(), TaskSettings(), seed=0)


def test_a_good_reply_keeps_integer_arrays_local_and_config_reaches_the_app() -> None:
    seen: list[dict[str, Any]] = []

    def reply(m: Message) -> RecordDict:
        seen.append(dict(m.content["config"]))
        arrays = m.content["arrays"].to_numpy_ndarrays()
        out = ArrayRecord({"w": _array(arrays[0] + 1), "n": _array(arrays[1] + 1)})
        return RecordDict({"arrays": out, "metrics": MetricRecord({"num-examples": 5,
                                                                   "train_loss": 0.5})})

    trainer = _trainer(_app(reply))
    trainer.on_pull(6)
    result = trainer.train(trainer.initial(), TaskSettings(lr=0.05), seed=2)
    assert result.num_examples == 5 and result.metrics == {"train_loss": 0.5}
    assert result.params is not None and np.all(result.params == 1.0)
    assert seen[0]["lr"] == 0.05 and seen[0]["server-round"] == 7
    assert int(trainer._arrays["n"][0]) == 5  # the client's counter moved on, not federated
    assert isinstance(ConfigRecord(seen[0]), ConfigRecord)


def test_a_message_app_without_a_serverapp_says_where_the_model_comes_from(
        tmp_path: Path) -> None:
    (tmp_path / "lone_app.py").write_text(
        "from flwr.clientapp import ClientApp\napp = ClientApp()\n\n"
        "@app.train()\ndef train(msg, context):\n    return msg\n")
    with pytest.raises(FlowerAppError, match="no model of its own, and no pyproject.toml"):
        load_flower_client(f"{tmp_path / 'lone_app.py'}:app")


def test_a_numpyclient_without_get_parameters_takes_the_serverapps_model(
        tmp_path: Path) -> None:
    """The older form, unchanged: a client_fn reading its run config, no get_parameters."""
    app = tmp_path / "legacy"
    (app / "legacy_app").mkdir(parents=True)
    (app / "legacy_app" / "__init__.py").write_text("")
    (app / "pyproject.toml").write_text(
        '[tool.flwr.app.components]\nserverapp = "legacy_app.server_app:app"\n'
        'clientapp = "legacy_app.client_app:app"\n[tool.flwr.app.config]\nbatch-size = 4\n')
    (app / "legacy_app" / "client_app.py").write_text(
        "import numpy as np\nfrom flwr.client import NumPyClient\n"
        "from flwr.clientapp import ClientApp\n\n"
        "class Client(NumPyClient):\n"
        "    def __init__(self, bs):\n        self.bs = bs\n"
        "    def fit(self, parameters, config):\n"
        "        return [p + self.bs for p in parameters], 8, {'loss': 1.0}\n\n"
        "def client_fn(context):\n"
        "    return Client(context.run_config['batch-size']).to_client()\n\n"
        "app = ClientApp(client_fn=client_fn)\n")
    (app / "legacy_app" / "server_app.py").write_text(
        "import numpy as np\nfrom flwr.app import ArrayRecord\n"
        "from flwr.serverapp import ServerApp\nfrom flwr.serverapp.strategy import FedAvg\n\n"
        "app = ServerApp()\n\n@app.main()\ndef main(grid, context):\n"
        "    FedAvg().start(grid=grid, initial_arrays=ArrayRecord([np.zeros(3, np.float32)]),"
        " num_rounds=1)\n")
    for ref in (f"{app / 'legacy_app' / 'client_app.py'}:client_fn", str(app)):
        trainer = load_flower_client(ref)
        assert isinstance(trainer, FlowerTrainer) and trainer.spec.size == 3
        result = trainer.train(trainer.initial(), TaskSettings(), seed=0)
        assert result.params is not None and result.params.tolist() == [4.0, 4.0, 4.0]


# -- real runs -------------------------------------------------------------------------------

@pytest.mark.integration
def test_murmura_run_trains_the_numpy_template_over_grpc(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["run", "--flower-app", str(NUMPY_APP), "--clients", "2", "--in-process",
                 "--out", str(out), "-q", "--timeout-s", "120"]) == 0
    rows = [r for r in _rows(out) if r["version"] > 0]
    assert len(rows) == 3  # the app's num-server-rounds
    assert all(r["client_train_updates"] == 2 and 0 <= r["client_train_random_metric_mean"] <= 1
               for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["flower_run_config"] == {"num-server-rounds": 3}


@pytest.mark.slow
@pytest.mark.integration
def test_murmura_run_trains_the_pytorch_template_in_client_processes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "murmura", "run", "--flower-app",
         f"{TORCH_APP}/quickstart_pytorch/client_app.py:app", "--clients", "3",
         "--max-versions", "2", "--out", str(out), "-q", "--timeout-s", "240"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = _rows(out)
    assert rows[-1]["version"] == 2 and rows[-1]["accuracy"] > 0.5  # chance: 0.1
    assert rows[-1]["client_train_loss_mean"] < rows[1]["client_train_loss_mean"] or \
        rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["client_train_updates"] == 2  # the app's fraction-train 0.5 of 3 clients


@pytest.mark.slow
def test_murmura_simulate_runs_the_pytorch_template_loop_and_pool(tmp_path: Path) -> None:
    accuracy = {}
    for executor in ("loop", "pool"):
        out = tmp_path / executor
        assert main(["simulate", "--flower-app", str(TORCH_APP), "--clients", "2",
                     "--executor", executor, "--workers", "2", "--out", str(out),
                     "-q"]) == 0
        rows = _rows(out)
        assert rows[-1]["version"] == 3 and "client_train_loss_mean" in rows[-1]
        accuracy[executor] = rows[-1]["accuracy"]
    assert accuracy["loop"] > 0.5
    assert accuracy["loop"] == accuracy["pool"]  # seeded: the same training either way
