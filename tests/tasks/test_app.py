"""App files: loading and its errors, the bundled tasks as apps, rules by name, client
evaluation (hold-out, cadence, the server's mean/min/max)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from murmura.aggregation import create_aggregator
from murmura.client.app import EvaluatingTrainer, task_trainer
from murmura.protocols import ModelSpec, TaskSettings
from murmura.server import ServerConfig
from murmura.server.client_eval import ClientEvals, report_from_metrics
from murmura.tasks import ArrayDataset, TaskConfig, load_task
from murmura.tasks.app import AppError, holdout, load_app
from tests.tasks.app_fixture import write_app

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(body, encoding="utf-8")
    return path


GOOD_MODEL = "from torch import nn\ndef model():\n    return nn.Linear(2, 2)\n"


@pytest.mark.parametrize(("body", "message"), [
    ("def client_data(i, n):\n    return None\n", "defines no model()"),
    (GOOD_MODEL, "defines no client_data()"),
    ("model = 3\ndef client_data(i, n):\n    return None\n", "model must be a function"),
    ("import not_a_module_anywhere\n", "importing it failed: ModuleNotFoundError"),
    ("def model(:\n", "importing it failed: SyntaxError"),
])
def test_an_app_missing_something_fails_at_load_with_a_one_line_error(tmp_path, body,
                                                                      message) -> None:
    path = _write(tmp_path, f"bad_{abs(hash(body)) % 10**8}", body)
    with pytest.raises(AppError, match=message) as info:
        TaskConfig(app=str(path))
    assert "\n" not in str(info.value) and str(info.value).startswith(f"app {path.name}: ")


def test_no_such_app_file_or_not_python(tmp_path) -> None:
    with pytest.raises(AppError, match="no such file"):
        load_app(tmp_path / "missing.py")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(AppError, match="expected a Python file"):
        load_app(tmp_path / "data.txt")


def test_an_app_returning_the_wrong_thing_names_the_function(tmp_path) -> None:
    path = _write(tmp_path, "wrong_returns", GOOD_MODEL + (
        "def client_data(i, n):\n    return [1, 2, 3]\n"
        "def test_data():\n    return 'text'\n"))
    with pytest.raises(AppError, match=r"test_data\(\) must return an ArrayDataset"):
        load_task(TaskConfig(app=str(path)))
    path = _write(tmp_path, "wrong_model", "def model():\n    return 3\n"
                  "def client_data(i, n):\n    return None\n")
    with pytest.raises(AppError, match=r"model\(\) must return a torch.nn.Module, got int"):
        load_task(TaskConfig(app=str(path))).build_model()
    path = _write(tmp_path, "wrong_data", GOOD_MODEL + "def client_data(i, n):\n    return 7\n")
    task = load_task(TaskConfig(app=str(path)))
    with pytest.raises(AppError, match=r"client_data\(\) must return an ArrayDataset or an "
                                       r"\(x, y\) pair of arrays, got int"):
        task.client_data(0, 2)


def test_a_train_function_without_num_examples_is_refused_with_the_reason(tmp_path) -> None:
    path = _write(tmp_path, "no_count", GOOD_MODEL + (
        "import numpy as np\n"
        "def client_data(i, n):\n    return np.zeros((4, 2), 'f4'), np.zeros(4, 'i8')\n"
        "def train(model, data, settings, seed):\n    return {'loss': 1.0}\n"))
    task = load_task(TaskConfig(app=str(path)))
    trainer = task_trainer(task, task.client_data(0, 1))
    spec = ModelSpec.from_module(task.build_model())
    with pytest.raises(AppError, match="positive 'num_examples'"):
        trainer.train(spec.flatten(task.build_model()), TaskSettings(), seed=1)


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_the_bundled_tasks_as_example_apps_match_the_bundled_tasks(name) -> None:
    bundled = load_task(TaskConfig(task=name))
    app = load_task(TaskConfig(app=str(ROOT / "examples" / f"{name}_app.py")))
    a, b = bundled.build_model(seed=3), app.build_model(seed=3)
    spec = ModelSpec.from_module(a)
    assert spec.fingerprint() == ModelSpec.from_module(b).fingerprint()
    np.testing.assert_array_equal(spec.flatten(a), spec.flatten(b))
    for i in range(4):
        mine, theirs = bundled.client_data(i, 4), app.client_data(i, 4)
        np.testing.assert_array_equal(mine.x, theirs.x)
        np.testing.assert_array_equal(mine.y, theirs.y)
    np.testing.assert_array_equal(bundled.test.y, app.test.y)


def test_app_rules_are_selectable_by_name_and_a_taken_name_is_refused(tmp_path) -> None:
    path = write_app(tmp_path, "rules_app", suffix="unit")
    TaskConfig(app=str(path))
    assert ServerConfig.from_flat(defense="frozen-unit").policy.defense == "frozen-unit"
    agg = create_aggregator("frozen-unit", 4)
    agg.add(np.ones(4, np.float32), 1.0)
    np.testing.assert_array_equal(agg.result(), np.zeros(4, np.float32))
    assert load_app(path) is load_app(str(path))  # loaded once: the rule registered once
    other = write_app(tmp_path / "..", "rules_app_copy", suffix="unit")
    with pytest.raises(AppError, match="aggregator 'frozen-unit' is already registered"):
        load_app(other)


def test_holdout_is_seeded_disjoint_and_keeps_the_data_kind() -> None:
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(50, 3)).astype(np.float32),
                        rng.integers(0, 3, 50).astype(np.int64))
    split = holdout(data, seed=4)
    assert split is not None
    train, test = split
    assert len(train) + len(test) == 50 and 5 <= len(test) <= 15
    again = holdout(data, seed=4)
    assert again is not None
    np.testing.assert_array_equal(again[1].x, test.x)
    rows = {tuple(r) for r in train.x}
    assert not any(tuple(r) in rows for r in test.x)
    pair = holdout((data.x, data.y), seed=4)
    assert pair is not None and isinstance(pair[1], tuple)
    np.testing.assert_array_equal(pair[1][0], test.x)
    assert holdout(ArrayDataset(data.x[:1], data.y[:1]), seed=0) is None


def test_client_evaluation_holds_out_a_split_and_reports_every_n_versions() -> None:
    task = load_task(TaskConfig(task="digits"))
    data = task.client_data(0, 5)
    base = task_trainer(task, data, device="cpu")
    trainer = EvaluatingTrainer(base, task=task, base=base, data=data, index=0,
                                num_clients=5, seed=0)
    params = ModelSpec.from_module(task.build_model()).flatten(task.build_model())
    settings = TaskSettings(local_epochs=0, local_steps=1, client_eval_every=2)
    reports = []
    for version in range(5):
        trainer.on_pull(version)
        result = trainer.train(params, settings, seed=version)
        reports.append(result.metrics.get("eval_version"))
    assert reports == [0.0, None, 2.0, None, 4.0]
    test = trainer.test_split()
    assert len(base.first_order.data) + len(test) == len(data)  # trains on the rest
    assert result.metrics["eval_examples"] == len(test)
    assert 0 <= result.metrics["eval_accuracy"] <= 1 and result.metrics["eval_loss"] > 0
    off = task_trainer(task, data, device="cpu")
    quiet = EvaluatingTrainer(off, task=task, base=off, data=data, index=0, num_clients=5)
    quiet.on_pull(0)
    assert "eval_version" not in quiet.train(params, TaskSettings(local_epochs=0, local_steps=1),
                                             seed=0).metrics
    assert len(off.first_order.data) == len(data)  # evaluation off: all data trains


def test_the_server_folds_reports_into_weighted_mean_min_and_max() -> None:
    evals = ClientEvals()
    for cid, n, acc in (("a", 10, 0.5), ("b", 30, 0.9), ("c", 60, 0.7)):
        report = report_from_metrics(cid, {"eval_version": 4.0, "eval_examples": float(n),
                                           "eval_accuracy": acc, "train_loss": 1.0})
        assert report is not None
        evals.add(report)
    refused = report_from_metrics("d", {"eval_version": 4.0, "eval_examples": 5.0,
                                        "eval_accuracy": 0.0})
    assert refused is not None
    evals.add(refused)
    evals.discard(refused)  # its update was refused after all
    row = evals.flush()
    assert row["client_accuracy_mean"] == pytest.approx((5 + 27 + 42) / 100)
    assert row["client_accuracy_min"] == 0.5 and row["client_accuracy_max"] == 0.9
    assert row["client_eval_clients"] == 3 and row["client_eval_examples"] == 100
    assert row["client_eval_versions"] == [4, 4]
    assert "client_train_loss_mean" not in row
    assert evals.flush() == {}
    assert report_from_metrics("e", {"train_loss": 1.0}) is None
    assert report_from_metrics("e", {"eval_version": 1.5, "eval_examples": 3.0}) is None
    assert report_from_metrics("e", {"eval_version": 1.0, "eval_examples": 1e300}) is None
    assert report_from_metrics("e", {"eval_version": 1.0, "eval_examples": 3.0,
                                     "eval_accuracy": 1e300}) is None
    json.dumps(row)


def test_murmura_new_writes_an_app_that_loads_and_trains(tmp_path) -> None:
    from murmura.cli import main

    assert main(["new", "starter", "--dir", str(tmp_path)]) == 0
    assert main(["new", "starter", "--dir", str(tmp_path)]) == 2  # never overwrites
    assert main(["new", "bad name!", "--dir", str(tmp_path)]) == 2
    task = load_task(TaskConfig(app=str(tmp_path / "starter.py")))
    data = task.client_data(1, 4)
    trainer = task_trainer(task, data)
    params = ModelSpec.from_module(task.build_model()).flatten(task.build_model())
    result = trainer.train(params, TaskSettings(local_epochs=1), seed=0)
    assert result.num_examples == len(data[1])
    assert task.test is not None and task.evaluate(task.build_model(), task.test)["accuracy"] >= 0


def test_the_spirals_example_app_trains_evaluates_and_clips_by_name() -> None:
    task = load_task(TaskConfig(app=str(ROOT / "examples" / "spirals_app.py")))
    data = task.client_data(2, 4)
    trainer = task_trainer(task, data)
    start = task.build_model(seed=0)
    spec = ModelSpec.from_module(start)
    result = trainer.train(spec.flatten(start), TaskSettings(lr=0.01, local_epochs=1), seed=0)
    assert result.num_examples == 300 and result.metrics["train_loss"] > 0
    figures = task.evaluate(task.build_model(), task.test)
    assert set(figures) == {"accuracy", "loss", "outer_accuracy"}
    agg = create_aggregator("spirals-clipped-mean", 2, scale=1.0)
    for update in ([1.0, 0.0], [0.0, 1.0], [30.0, 0.0]):  # the last is clipped to norm 1
        agg.add(np.asarray(update, np.float32), 1.0)
    np.testing.assert_allclose(agg.result(), [2 / 3, 1 / 3], rtol=1e-6)


def test_the_config_file_names_an_app_and_the_eval_interval(tmp_path) -> None:
    from murmura.config import build, read_toml

    path = write_app(tmp_path, "toml_app", suffix="toml")
    (tmp_path / "run.toml").write_text(f'[task]\napp = "{path}"\n\n'
                                       f'[server]\nclient_eval_every = 3\n')
    toml = read_toml(tmp_path / "run.toml")
    assert build(TaskConfig, toml["task"], section="task").app == str(path)
    assert build(ServerConfig, toml["server"], section="server").train.client_eval_every == 3
