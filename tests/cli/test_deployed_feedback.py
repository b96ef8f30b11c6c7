"""Feedback while deployed: ``murmura server`` prints a line per version and the run's result
line; ``murmura client`` a line per finished task and what it knows at the end. Real
processes on loopback; the assertions read their output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

MURMURA = [sys.executable, "-m", "murmura"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _address(server: subprocess.Popen[str], timeout_s: float = 120) -> str:
    """The address from the server's first stdout line, read in a thread so the wait ends."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(server.stdout.readline()),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert line and "listening on 127.0.0.1:" in line[0], (line, server.poll())
    return line[0].split()[-1]


def _serve(tmp_path: Path, procs: list, *extra: str) -> tuple[subprocess.Popen[str], str]:
    server = subprocess.Popen(
        [*MURMURA, "server", "--address", "127.0.0.1:0", "--out", str(tmp_path / "srv"),
         "--max-versions", "2", "--min-clients", "2", "--workers", "0", "--local-epochs", "1",
         "--linger-s", "2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    procs.append(server)
    return server, _address(server)


def _clients(address: str, procs: list, *quiet: str) -> list[subprocess.Popen[str]]:
    """Two clients: the first with ``quiet``'s flags, the second without."""
    started = [subprocess.Popen(
        [*MURMURA, "client", "--server", address, "--client-index", str(i), "--num-clients",
         "2", *(quiet if i == 0 else ())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for i in range(2)]
    procs.extend(started)
    return started


@pytest.mark.integration
@pytest.mark.slow
def test_server_and_client_report_while_deployed(tmp_path, procs) -> None:
    server, address = _serve(tmp_path, procs)
    quiet, loud = _clients(address, procs, "-q")
    q_out, q_err = quiet.communicate(timeout=180)
    out, err = loud.communicate(timeout=180)
    rest, server_err = server.communicate(timeout=60)
    assert quiet.returncode == loud.returncode == server.returncode == 0, (err, server_err)

    # the server: one line per version (version, accuracy, updates, clients), then the result
    versions = [line for line in server_err.splitlines() if "] version " in line]
    assert [re.search(r"version (\d)/2", line)[1] for line in versions] == ["1", "2"]  # type: ignore[index]
    for line in versions:
        assert re.search(r"acc \d\.\d{3}  updates \d+  clients 2", line), line
    result = re.search(r"final test accuracy (\d\.\d{4}) after 2 versions \((\d+) updates, "
                       r"[\d.]+ MB up\) in [\d.]+ s", rest)
    assert result is not None, rest
    assert int(result[2]) >= 4 and "stopped at version 2" in rest

    # a client: a line per task (version, examples, loss, what the push became), then totals
    tasks = [line for line in out.splitlines() if line.startswith("task ")]
    assert len(tasks) == 2, out
    for n, line in enumerate(tasks):
        assert re.fullmatch(rf"task {n + 1}: version {n}, \d+ examples, loss \d+\.\d{{4}} -> "
                            r"pushed \(staleness 0\)", line), line
    assert re.search(r"client \S+: 2 updates pushed, 0 refused, \d+ retries; trained on "
                     r"versions 0\.\.1$", out.strip()), out
    # -q: no task lines, the closing line still
    assert not [line for line in q_out.splitlines() if line.startswith("task ")], q_out
    assert "2 updates pushed" in q_out


@pytest.mark.integration
@pytest.mark.slow
def test_a_quiet_server_prints_no_progress_but_its_result(tmp_path, procs) -> None:
    server, address = _serve(tmp_path, procs, "-q")
    for client in _clients(address, procs, "-q"):
        client.communicate(timeout=180)
    rest, server_err = server.communicate(timeout=60)
    assert server.returncode == 0, server_err
    assert "] version " not in server_err and "waiting for clients" not in server_err
    assert "final test accuracy" in rest and "after 2 versions" in rest


@pytest.mark.integration
@pytest.mark.slow
def test_launch_counts_tasks_and_ends_at_the_final_version(tmp_path, procs) -> None:
    server, address = _serve(tmp_path, procs)
    launch = subprocess.Popen(
        [*MURMURA, "launch", "--server", address, "--devices", "cpu,cpu", "--table-every-s",
         "0.5", "--work-dir", str(tmp_path / "launch")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    procs.append(launch)
    out, err = launch.communicate(timeout=240)
    server.communicate(timeout=60)
    assert launch.returncode == 0, err[-2000:]
    lines = out.splitlines()
    final = [line for line in lines[-4:-1] if line.startswith("launch-")]
    assert len(final) == 2, out[-2000:]
    for row in final:  # client, device, state, version, tasks: the run's last version, 2
        assert row.split()[2:5] == ["done", "2", "2"], row
    assert lines[-1] == "murmura launch: 2/2 clients done, 4 tasks, last version 2, 0 restarts"
    # while they ran, the table showed each client's state before its first model
    states = {line.split()[2] for line in lines if line.startswith("launch-")}
    assert "done" in states and states <= {"starting", "running", "done"}, states


@pytest.mark.integration
@pytest.mark.slow
def test_a_peer_prints_its_accuracy_each_round_and_at_the_end(tmp_path) -> None:
    base = [*MURMURA, "peer", "--listen", "127.0.0.1:0", "--rounds", "2", "--local-steps", "1"]
    loud = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=ENV)
    quiet = subprocess.run([*base, "-q"], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env=ENV)
    assert loud.returncode == quiet.returncode == 0, loud.stderr[-2000:]
    rounds = [line for line in loud.stdout.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 1/2", "round 2/2"], loud.stdout
    last = re.search(r"accuracy (\d\.\d{4})", rounds[-1])
    assert last is not None and all(re.search(r"accuracy \d\.\d{4}, mixed \d+ models", line)
                                    for line in rounds)
    assert f"2 rounds, 0 models sent, 0 received, 0 failed sends; final test accuracy " \
           f"{last[1]}" in loud.stdout
    assert "round " not in quiet.stdout and "final test accuracy" in quiet.stdout


def test_versions_made_between_two_polls_each_get_their_line(tmp_path) -> None:
    # A fast run can make several versions between two of the server's progress polls; the
    # ones in between are read back from the run's rows, so every version gets its line.
    import io

    from murmura.progress import Progress
    from murmura.serve import _show_versions
    from murmura.server import ServerConfig
    from murmura.simulation import Simulation, SimulationConfig
    from murmura.tasks import TaskConfig

    sim = Simulation(TaskConfig(task="synthetic", model="logreg"),
                     ServerConfig.from_flat(max_versions=3, seed=0),
                     SimulationConfig(clients=4, out=str(tmp_path / "sim")))
    sim.run()  # three versions, no poll in between
    out = io.StringIO()
    _show_versions(sim.core, Progress(3, stream=out))
    assert [re.search(r"version (\d)/3", line)[1]  # type: ignore[index]
            for line in out.getvalue().splitlines()] == ["1", "2", "3"]
