"""An app whose evaluate() returns the wrong thing: refused before the run starts with one
line naming the app and the expected return type; a later failure never stalls the run."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from murmura.server import ServerConfig
from murmura.simulation import SimulationConfig, simulate
from murmura.tasks import TaskConfig
from murmura.tasks.app import AppError

ROOT = Path(__file__).resolve().parents[2]

APP = '''
import numpy as np
from torch import nn

CALLS = [0]


def model():
    return nn.Linear(2, 2)


def client_data(index, num_clients):
    rng = np.random.default_rng(index)
    return rng.normal(size=(20, 2)).astype(np.float32), rng.integers(0, 2, 20)


def test_data():
    return client_data(99, 100)


def evaluate(model, data):
    CALLS[0] += 1
    return {FIRST}
'''


def _app(tmp_path: Path, name: str, first: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(APP.replace("{FIRST}", first), encoding="utf-8")
    return path


def test_a_float_from_evaluate_stops_simulate_before_it_starts(tmp_path: Path) -> None:
    app = _app(tmp_path, "float_eval", "0.5")
    with pytest.raises(AppError) as info:
        simulate(TaskConfig(app=str(app)), ServerConfig.from_flat(max_versions=2),
                 SimulationConfig(clients=2), out_dir=None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("app float_eval.py: evaluate() must return a dict of metrics")
    assert "got float" in message


def test_murmura_simulate_exits_2_with_one_line(tmp_path: Path) -> None:
    app = _app(tmp_path, "float_eval_cli", "0.5")
    done = subprocess.run(
        [sys.executable, "-m", "murmura", "simulate", "--app", str(app), "--clients", "2",
         "--max-versions", "2", "--out", str(tmp_path / "out")],
        cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert lines[-1].endswith("got float (a bare number does not say what it measures)")
    assert "float_eval_cli.py: evaluate() must return a dict" in lines[-1]


def test_evaluation_failing_later_publishes_versions_without_metrics(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each version used to be dropped when the server's evaluation failed: the run never
    reached max_versions. Now the version is published and the failure logged."""
    app = _app(tmp_path, "late_float_eval", "{'accuracy': 0.5} if CALLS[0] == 1 else 0.5")
    with caplog.at_level(logging.ERROR, logger="murmura.server"):
        result = simulate(TaskConfig(app=str(app)),
                          ServerConfig.from_flat(max_versions=3, min_clients=2),
                          SimulationConfig(clients=2), out_dir=None)
    assert result.version == 3 and len(result.rows) == 3
    assert all("accuracy" not in row for row in result.rows)
    failures = [r.getMessage() for r in caplog.records if "without the server's evaluation"
                in r.getMessage()]
    assert len(failures) == 3 and "got float" in failures[0]
