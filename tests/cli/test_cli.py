"""The murmura command: help, config files, run end to end, server shutdown on signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from murmura.cli import build_parser, main
from murmura.config import build, read_toml
from murmura.server import ServerConfig

SUBCOMMANDS = ["run", "server", "client", "peer", "simulate"]


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_has_help(sub, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([sub, "--help"])
    assert exit_.value.code == 0
    assert "--config" in capsys.readouterr().out


def test_python_dash_m_murmura_is_the_same_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "murmura", "--version"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.startswith("murmura ")


def test_toml_then_flags_map_onto_config_fields(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nmode = "async"\nbuffer_size = 7\nlr = 0.3\n'
                   '[server.train]\ncodec = "dense-f16"\n')
    args = build_parser().parse_args(["server", "--config", str(cfg), "--buffer-size", "9",
                                      "--codec-option", "x=1"])
    server = build(ServerConfig, read_toml(cfg).get("server"), args, section="server")
    assert (server.mode, server.policy.buffer_size) == ("async", 9)  # the flag wins over the file
    assert server.train.lr == 0.3 and server.train.codec == "dense-f16"
    assert server.train.codec_options == {"x": "1"}


def test_config_errors_are_clear_and_exit_2(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nbuffer_sise = 3\n")
    assert main(["run", "--config", str(cfg)]) == 2
    assert "unknown key 'buffer_sise' in [server]" in capsys.readouterr().err
    assert main(["run", "--mode", "semi-sync"]) == 2
    assert "mode must be one of" in capsys.readouterr().err
    assert main(["run", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.integration
def test_murmura_run_end_to_end_with_client_processes(tmp_path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "murmura", "run", "--clients", "3", "--max-versions", "4",
         "--out", str(out), "--local-epochs", "1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "final test accuracy" in proc.stdout and str(out) in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    for key in ("time_s", "accuracy", "loss", "updates", "bytes_up", "bytes_down"):
        assert key in rows[-1]
    assert rows[-1]["updates"] == 12 and rows[-1]["bytes_up"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == 4 and summary["config"]["run"]["clients"] == 3
    assert (out / "accuracy.png").stat().st_size > 1000
    logs = sorted((out / "clients").glob("client-*.log"))
    assert len(logs) == 3
    # every client proved a key (ids derive from keys) and had its signed updates counted
    assert all("client n-" in log.read_text() and "4 updates pushed, 0 refused"
               in log.read_text() for log in logs)


@pytest.mark.integration
@pytest.mark.slow
def test_murmura_run_gossip_writes_one_row_per_round_over_peers(tmp_path) -> None:
    out = tmp_path / "gossip"
    proc = subprocess.run(
        [sys.executable, "-m", "murmura", "run", "--gossip", "--clients", "3", "--rounds", "3",
         "--out", str(out), "--local-epochs", "1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "final mean test accuracy" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["peers"] == 3 and row["bytes_up"] > 0 and row["consensus_distance"] > 0
        assert row["accuracy_min"] <= row["accuracy"] <= row["accuracy_max"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["config"]["gossip"]["topology"] == "epidemic"
    assert (out / "accuracy.png").stat().st_size > 1000
    assert not list((out / "peers").glob("*.npy"))  # read and cleaned up


@pytest.mark.integration
@pytest.mark.slow
def test_murmura_run_gossip_modest_writes_the_rounds_aggregates(tmp_path) -> None:
    out = tmp_path / "modest"
    proc = subprocess.run(
        [sys.executable, "-m", "murmura", "run", "--gossip", "--clients", "4", "--rounds", "4",
         "--topology", "modest", "--sample-size", "2", "--aggregators", "2", "--out",
         str(out), "--local-epochs", "1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    for row in rows:  # a row holds the round's aggregators' models: 2 trained models each
        assert 1 <= row["peers"] <= 2 and row["updates_in_round"] == 2 * row["peers"]
    assert rows[-1]["updates"] == sum(r["updates_in_round"] for r in rows)  # the run's total
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]


@pytest.mark.integration
@pytest.mark.parametrize("backend", [
    "process",
    # ray.init installs its own SIGTERM handler (exit status 15 after a native stack dump);
    # the server must keep its graceful shutdown with the Ray backend too
    pytest.param("ray", marks=pytest.mark.slow),
])
def test_server_logs_its_bound_port_and_stops_cleanly_on_sigterm(tmp_path, backend) -> None:
    if backend == "ray":
        pytest.importorskip("ray", reason="Ray is an extra: pip install -e \".[ray]\" (in dev)")
    out = tmp_path / "srv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "murmura", "server", "--address", "127.0.0.1:0", "--out",
         str(out), "--backend", backend], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line
        port = int(line.rsplit(":", 1)[1])
        assert port > 0
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert "stopped at version 0" in rest
    assert (out / "summary.json").exists()


def test_run_in_process_resumes_nothing_and_writes_outputs(tmp_path, capsys) -> None:
    out = tmp_path / "inproc"
    code = main(["run", "--in-process", "--clients", "2", "--max-versions", "2",
                 "--local-epochs", "1", "--out", str(out), "-q"])
    assert code == 0
    quiet = capsys.readouterr()
    assert "final test accuracy" in quiet.out
    # -q: no banner, start-up or progress lines, no line per client; the result and the files
    assert quiet.err.strip() == "", quiet.err
    assert len(quiet.out.splitlines()) == 2, quiet.out
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert Path(out / "checkpoint.npz").exists()


def test_gossip_rows_do_not_wait_for_a_round_a_peer_jumped_past(tmp_path) -> None:
    from murmura.peers import GossipRun

    (tmp_path / "a.jsonl").write_text("".join(
        json.dumps({"round": r, "accuracy": 0.5, "bytes_sent": 10}) + "\n" for r in range(3)))
    (tmp_path / "b.jsonl").write_text(json.dumps({"round": 2, "accuracy": 0.7}) + "\n")
    follow = GossipRun(tmp_path, ["a", "b"])
    follow.poll()

    rows = follow.complete({"a", "b"})

    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[0]["peers"] == 1 and rows[2]["peers"] == 2 and rows[2]["accuracy"] == 0.6


def test_a_lone_peer_says_it_is_the_first_and_warns_that_it_trained_alone(tmp_path) -> None:
    """Forgetting --bootstrap must not pass silently: without it the peer says it starts a
    new network (and how others join); a peer that never reached anyone says so at the end.
    With --min-peers it waits instead, so only the end-of-run warning is printed."""
    base = [sys.executable, "-m", "murmura", "peer", "--listen", "127.0.0.1:0", "--rounds", "1",
            "--local-steps", "1"]
    first = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path)
    waiting = subprocess.Popen([*base, "--min-peers", "2", "--start-timeout-s", "0.5"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=tmp_path)
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = waiting.communicate(timeout=120)
    assert first.returncode == waiting.returncode == 0, (err1, err2)
    address = out1.split("listening on ")[1].split()[0]
    assert "first peer of a new network" in err1 and f"--bootstrap {address}" in err1
    assert "first peer of a new network" not in err2
    for err in (err1, err2):
        assert "warning: no other peer was ever reached" in err
    assert "1 rounds, 0 models sent, 0 received" in out1
