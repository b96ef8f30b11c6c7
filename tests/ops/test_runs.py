"""``murmura runs`` over real run directories (made by ``murmura simulate`` and ``murmura
run``), the states a run's files give (running, crashed, finished, incomplete), hostile
contents, and run names that try to leave the directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from murmura.cli import main
from murmura.runs import PIDFILE, TAIL_BYTES, LiveRun, describe_run, last_rows


def runs_json(capsys, *argv: str) -> list[dict]:
    assert main(["runs", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding one finished ``murmura simulate`` run, ``sim``."""
    root = tmp_path_factory.mktemp("runs")
    code = main(["simulate", "--clients", "8", "--max-versions", "3", "--mode", "async",
                 "--buffer-size", "4", "--task", "synthetic", "--samples-per-client", "10",
                 "--local-steps", "1", "--out", str(root / "sim"), "-q"])
    assert code == 0
    return root


def test_a_finished_simulation_is_listed_with_its_results(simulated: Path, capsys) -> None:
    summary = json.loads((simulated / "sim" / "summary.json").read_text())

    listed = runs_json(capsys, str(simulated))

    assert [(r["name"], r["command"], r["mode"], r["state"], r["versions"]) for r in listed] \
        == [("sim", "simulate", "async", "finished", 3)]
    assert listed[0]["accuracy"] == summary["final_accuracy"]
    assert main(["runs", str(simulated)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "COMMAND", "MODE", "STATE", "VERSIONS", "ACCURACY",
                                "MODIFIED"]
    assert table[1].split()[:5] == ["sim", "simulate", "async", "finished", "3"]


def test_show_prints_the_config_summary_and_last_rows(simulated: Path, capsys) -> None:
    assert main(["runs", "show", "sim", "--dir", str(simulated), "--rows", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("run sim (") and "finished" in text
    assert '"simulation"' in text and '"max_versions": 3' in text
    assert text.count('"version":') == 2  # the last two rows

    assert main(["runs", "show", "sim", "--dir", str(simulated), "--json", "--rows", "10"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in shown["rows"]] == [1, 2, 3]
    assert shown["config"]["server"]["mode"] == "async" and "config" not in shown["summary"]


def test_states_follow_the_pid_file(tmp_path: Path, capsys) -> None:
    root = tmp_path / "runs"
    # running: this process serves it (LiveRun writes the pid file)
    live = LiveRun(root / "live", "server").serving("127.0.0.1:50051")
    # crashed: a pid file whose process is gone
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (root / "dead").mkdir(parents=True)
    (root / "dead" / PIDFILE).write_text(json.dumps({"pid": int(gone.stdout), "command": "run",
                                                     "mode": "async"}))
    (root / "dead" / "metrics.jsonl").write_text(json.dumps({"version": 4, "accuracy": 0.5})
                                                 + "\n")
    # a reused pid: alive, but not the process that wrote the file
    (root / "reused").mkdir()
    (root / "reused" / PIDFILE).write_text(json.dumps({"pid": os.getpid(),
                                                       "start_ticks": "1", "command": "run"}))
    # incomplete: rows and no summary, no pid file
    (root / "partial").mkdir()
    (root / "partial" / "metrics.jsonl").write_text(json.dumps({"version": 1}) + "\n")
    (root / "not-a-run").mkdir()  # no run files: not listed

    states = {r["name"]: r for r in runs_json(capsys, str(root))}

    assert {n: r["state"] for n, r in states.items()} == {
        "live": "running", "dead": "crashed", "reused": "crashed", "partial": "incomplete"}
    assert (states["dead"]["command"], states["dead"]["mode"], states["dead"]["versions"]) == \
        ("run", "async", 4)
    live.close()
    assert not (root / "live" / PIDFILE).exists()
    assert describe_run(root / "live")["state"] == "incomplete"


@pytest.mark.parametrize("name", ["..", ".", "../sim", "sim/..", "sim/../sim", "/etc",
                                  "..\\sim", "", "x\0y", "nope", "a" * 300, "escape"])
def test_show_refuses_names_that_are_not_a_run_directly_under_dir(
        simulated: Path, name: str, capsys) -> None:
    outside = simulated.parent / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "summary.json").write_text("{}")
    if not (simulated / "escape").exists():
        (simulated / "escape").symlink_to(outside, target_is_directory=True)

    assert main(["runs", "show", name, "--dir", str(simulated)]) == 2

    err = capsys.readouterr().err
    assert err.startswith("murmura: error:") and len(err.strip().splitlines()) == 1
    assert "outside" not in err


def test_hostile_run_files_are_read_within_bounds(tmp_path: Path, capsys) -> None:
    root = tmp_path / "runs"
    big = root / "big"
    big.mkdir(parents=True)
    with (big / "metrics.jsonl").open("w") as f:  # ~4 MB of rows, a torn last line
        for v in range(1, 20_001):
            f.write(json.dumps({"version": v, "accuracy": v / 20_000, "pad": "x" * 150}) + "\n")
        f.write('{"version": 20001, "acc')
    (root / "garbage").mkdir()
    (root / "garbage" / "summary.json").write_text("not json {")
    (root / "list").mkdir()
    (root / "list" / "summary.json").write_text("[1, 2, 3]")

    states = {r["name"]: r for r in runs_json(capsys, str(root))}

    assert (states["big"]["state"], states["big"]["versions"]) == ("incomplete", 20_000)
    assert states["big"]["accuracy"] == 1.0
    assert [r["version"] for r in last_rows(big / "metrics.jsonl", 3)] == [19_998, 19_999,
                                                                          20_000]
    assert (big / "metrics.jsonl").stat().st_size > 10 * TAIL_BYTES
    assert states["garbage"]["state"] == states["list"]["state"] == "incomplete"


def test_a_missing_or_empty_directory(tmp_path: Path, capsys) -> None:
    assert main(["runs", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["runs", str(tmp_path)]) == 0
    assert "no runs in" in capsys.readouterr().out
    assert main(["runs", "show"]) == 2
    assert main(["runs", "a", "b"]) == 2


def test_runs_loads_no_torch(simulated: Path) -> None:
    probe = ("import sys\nfrom murmura.cli import main\ncode = main(['runs', sys.argv[1]])\n"
             "print('LOADED', 'torch' in sys.modules, code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(simulated)], capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "LOADED False 0", proc.stderr


@pytest.mark.slow
@pytest.mark.integration
def test_a_murmura_run_with_metrics_leaves_a_finished_run(tmp_path: Path, capsys) -> None:
    root = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "murmura", "run", "--clients", "2", "--max-versions", "2",
         "--out", str(root / "tiny"), "--metrics-address", "127.0.0.1:0", "--local-steps",
         "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Prometheus metrics on http://127.0.0.1:" in proc.stderr

    listed = runs_json(capsys, str(root))

    assert [(r["name"], r["command"], r["mode"], r["state"], r["versions"]) for r in listed] \
        == [("tiny", "run", "sync", "finished", 2)]
    assert not (root / "tiny" / PIDFILE).exists()
    summary = json.loads((root / "tiny" / "summary.json").read_text())
    assert summary["config"]["server"]["metrics_address"] == "127.0.0.1:0"
