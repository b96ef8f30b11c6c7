"""``--app`` end to end: a custom app file (own model, own data, own train/evaluate, own rule)
through ``murmura run`` and through ``murmura server`` with separate ``murmura client``
processes; client evaluation rows checked against what the clients measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tasks.app_fixture import write_app

SERVER_TEST = 400  # the app's server test set size (its clients' are 30 + 20 * index)


def _env(log: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "APP_TEST_LOG": str(log)}


def _client_evals(log: Path) -> dict[int, list[dict[str, float]]]:
    """The app's evaluation log, by client test-set size, in the order each client ran."""
    by_size: dict[int, list[dict[str, float]]] = defaultdict(list)
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "examples" in record and record["examples"] != SERVER_TEST:
            by_size[record["examples"]].append(record)
    return by_size


def _check_rows(rows: list[dict], log: Path, clients: int) -> None:
    """Row v + 1 holds every client's evaluation of version v (sync, eval every version):
    the weighted mean, min and max of what the app's evaluate() returned on each client."""
    evals = _client_evals(log)
    sizes = sorted(evals)
    assert sizes == [30 + 20 * i for i in range(clients)]
    for row in rows:
        v = row["version"] - 1
        assert row["client_eval_versions"] == [v, v]
        assert row["client_eval_clients"] == clients
        assert row["client_eval_examples"] == sum(sizes)
        accs = [evals[n][v]["accuracy"] for n in sizes]
        mean = sum(a * n for a, n in zip(accs, sizes, strict=True)) / sum(sizes)
        assert row["client_accuracy_mean"] == pytest.approx(mean, abs=1e-9)
        assert row["client_accuracy_min"] == pytest.approx(min(accs), abs=1e-9)
        assert row["client_accuracy_max"] == pytest.approx(max(accs), abs=1e-9)
        losses = [evals[n][v]["loss"] for n in sizes]
        assert row["client_loss_max"] == pytest.approx(max(losses), abs=1e-6)


@pytest.mark.integration
@pytest.mark.slow
def test_murmura_run_trains_a_custom_app_and_aggregates_client_evaluation(tmp_path) -> None:
    app = write_app(tmp_path, "run_app")
    log, out = tmp_path / "evals.jsonl", tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "murmura", "run", "--app", str(app), "--in-process",
         "--clients", "3", "--max-versions", "3", "--workers", "0", "--local-epochs", "1",
         "--client-eval-every", "1", "--out", str(out), "-q"],
        capture_output=True, text=True, timeout=300, env=_env(log))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "final test accuracy" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    _check_rows(rows, log, clients=3)
    assert rows[-1]["accuracy"] > 0.75  # the app's own train() learned the blobs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["task"]["app"] == str(app)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)


@pytest.mark.integration
@pytest.mark.slow
def test_murmura_server_and_separate_clients_run_a_custom_app_and_its_rule(tmp_path,
                                                                           procs) -> None:
    """``murmura server --app`` as its own process, aggregating with the app's rule chosen
    by name; two ``murmura client --app`` entries (threads of this process: an interpreter
    start each costs more than the run) join it over gRPC."""
    from murmura.cli import main

    app = write_app(tmp_path, "served_app")
    log, out = tmp_path / "evals.jsonl", tmp_path / "srv"
    server = subprocess.Popen(
        [sys.executable, "-m", "murmura", "server", "--app", str(app), "--address",
         "127.0.0.1:0", "--out", str(out), "--max-versions", "2", "--min-clients", "2",
         "--workers", "0", "--local-epochs", "1", "--client-eval-every", "1",
         "--defense", "frozen-served_app", "--linger-s", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(log))
    procs.append(server)
    assert server.stdout is not None
    line = server.stdout.readline()
    assert "listening on 127.0.0.1:" in line, line or server.communicate(timeout=30)[1][-2000:]
    address = line.split()[-1]
    os.environ["APP_TEST_LOG"] = str(log)  # the clients' app module reads it at import
    try:
        codes: list[int] = []
        threads = [threading.Thread(target=lambda i=i: codes.append(main(
            ["client", "--app", str(app), "--server", address, "--client-index", str(i),
             "--num-clients", "2", "--profile", "--no-profile", "-q"])))
            for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        del os.environ["APP_TEST_LOG"]
    assert codes == [0, 0]
    rest, err = server.communicate(timeout=120)
    assert server.returncode == 0, err[-2000:]
    assert "stopped at version 2" in rest
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    _check_rows(rows, log, clients=2)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"rule": "frozen", "size": 42} in records  # 2*8 + 8 + 8*2 + 2 parameters
    assert rows[0]["accuracy"] == rows[1]["accuracy"]  # the frozen rule never moved it


@pytest.mark.parametrize(("command", "body", "message"), [
    ("run", None, "no such file"),
    ("server", "def model():\n    pass\n", "defines no client_data()"),
    ("simulate", "def model():\n    pass\ndef client_data(i, n):\n    return 1\n",
     "client_data() must return an ArrayDataset or an (x, y) pair of arrays, got int"),
])
def test_a_bad_app_file_gives_a_one_line_error_and_exit_2(tmp_path, capsys, command, body,
                                                          message) -> None:
    from murmura.cli import main

    path = tmp_path / "nowhere.py"
    if body is not None:
        path = tmp_path / f"bad_{command}.py"
        path.write_text(body)
    assert main([command, "--app", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"murmura {command}: app ") and message in err[-1], err
