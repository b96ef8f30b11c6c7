"""``murmura dashboard`` and ``--dashboard``: one-line errors (exit 2) before anything starts,
no torch for the dashboard command, and the real commands serving the page."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from murmura.cli import main
from tests.conftest import wait_until

TOKEN = "s3cret-token-for-tests-0123456789"
#: The tests that serve a dashboard need the ops extra (starlette, uvicorn); the others check
#: what is said without it.
needs_ops = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn")),
    reason='the dashboard needs the ops extra: pip install -e ".[ops]" (in dev)')


def run_dir(root: Path) -> Path:
    run = root / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"version": 1, "accuracy": 0.5}) + "\n")
    return run


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("murmura: error: "), err
    return err


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--run", "{missing}"], "no such directory"),
    (["--run", "{run}", "--address", "0.0.0.0:0"], "--token"),
    (["--run", "{run}", "--address", "0.0.0.0:0", "--token", TOKEN], "--tls-cert"),
    (["--run", "{run}", "--address", "0.0.0.0:0", "--token", "short", "--insecure"],
     "at least 16"),
    (["--run", "{run}", "--address", "nohost"], "HOST:PORT"),
    (["--run", "{run}", "--tls-cert", "{missing}", "--tls-key", "{missing}"], "no such file"),
])
def test_bad_dashboard_options_are_one_line_and_exit_2(tmp_path: Path, capsys,
                                                        argv: list[str], fragment: str) -> None:
    values = {"run": str(run_dir(tmp_path)), "missing": str(tmp_path / "missing")}
    assert main(["dashboard", *[a.format(**values) for a in argv]]) == 2
    assert fragment in one_error_line(capsys)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["server", "--dashboard", "0.0.0.0:0"], "--dashboard-token"),
    (["server", "--dashboard", "0.0.0.0:0", "--dashboard-token", TOKEN], "--tls-cert"),
    (["server", "--dashboard-token", TOKEN], "need --dashboard"),
    (["server", "--dashboard", "127.0.0.1:0", "--role", "leaf", "--upstream", "127.0.0.1:1"],
     "leaf"),
    (["run", "--gossip", "--dashboard", "127.0.0.1:0"], "gossip"),
    (["run", "--dashboard", "0.0.0.0:0", "--dashboard-token", TOKEN], "--tls-cert"),
])
def test_bad_dashboard_flags_of_server_and_run_are_refused_before_start(
        tmp_path: Path, capsys, argv: list[str], fragment: str) -> None:
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert fragment in one_error_line(capsys)
    assert not (tmp_path / "out").exists()  # nothing started


@needs_ops  # without the extra, the missing dependency is said first
def test_a_taken_port_is_found_before_anything_starts(tmp_path: Path, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert main(["dashboard", "--run", str(run_dir(tmp_path)), "--address", address]) == 2
        assert "already in use" in one_error_line(capsys)
        assert main(["server", "--dashboard", address, "--out", str(tmp_path / "o")]) == 2
        assert "--dashboard" in one_error_line(capsys)


def test_without_the_ops_extra_it_says_what_to_install(tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    import murmura.server.dashboard as dashboard

    monkeypatch.setattr(dashboard, "missing_dependency", lambda: "uvicorn")
    assert main(["dashboard", "--run", str(run_dir(tmp_path))]) == 2
    assert 'pip install "murmura[ops]"' in one_error_line(capsys)


def test_the_dashboard_command_loads_no_torch(tmp_path: Path) -> None:
    probe = ("import sys; from murmura.cli import main\n"
             "code = main(sys.argv[1:])\n"
             "print('TORCH', 'torch' in sys.modules, code)")
    for argv in (["dashboard", "--help"], ["dashboard", "--run", str(tmp_path / "none")]):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                              text=True, timeout=60)
        if argv[-1] == "--help":
            assert proc.returncode == 0 and "usage: murmura dashboard" in proc.stdout
        else:
            assert proc.stdout.strip().splitlines()[-1] == "TORCH False 2", proc.stdout


def _url(proc: subprocess.Popen[str], pattern: str, *, stream: str = "stdout",
         timeout: float = 120.0) -> str:
    """The first match of ``pattern`` in the process's output; the process is killed (and
    the test fails) if none comes within ``timeout`` seconds."""
    lines: list[str] = []
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        for line in getattr(proc, stream):
            lines.append(line)
            found = re.search(pattern, line)
            if found:
                return found.group(1)
    finally:
        watchdog.cancel()
    raise AssertionError(f"no dashboard line in {lines}")


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


@contextlib.contextmanager
def murmura(*argv: str, **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """``python -m murmura ARGV`` with piped text output, killed if still running at the end."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    proc = subprocess.Popen([sys.executable, "-m", "murmura", *argv], text=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_ops
def test_murmura_dashboard_serves_a_run_directory_until_interrupted(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    with murmura("dashboard", "--run", str(run), "--address", "127.0.0.1:0") as proc:
        url = _url(proc, r"murmura dashboard: (http://127\.0\.0\.1:\d+/) ")
        snap = _get_json(url + "api/snapshot")
        assert (snap["run"]["name"], snap["version"], snap["source"]) == ("r", 1, "files")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


@needs_ops
@pytest.mark.integration
def test_murmura_server_serves_its_dashboard_beside_the_aggregator(tmp_path: Path) -> None:
    out = tmp_path / "srv"
    with murmura("server", "--address", "127.0.0.1:0", "--out", str(out), "--dashboard",
                 "127.0.0.1:0", "--no-durable", "-q") as proc:
        url = _url(proc, r"murmura dashboard on (http://127\.0\.0\.1:\d+/)")
        snap = _get_json(url + "api/snapshot")
        assert (snap["source"], snap["role"], snap["run"]["name"]) == ("live", "server", "srv")
        assert snap["run"]["dir"] == str(out)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@needs_ops
@pytest.mark.slow
def test_murmura_run_serves_its_dashboard_while_it_trains(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with murmura("run", "--clients", "2", "--max-versions", "3", "--out", str(out),
                 "--dashboard", "127.0.0.1:0", stdout=subprocess.DEVNULL) as proc:
        url = _url(proc, r"murmura dashboard on (http://127\.0\.0\.1:\d+/)", stream="stderr",
                   timeout=240)
        snap = _get_json(url + "api/snapshot")
        assert snap["source"] == "live" and snap["run"]["dir"] == str(out)
        proc.communicate(timeout=300)  # reads the progress lines to the end
        assert proc.returncode == 0


@needs_ops
@pytest.mark.integration
def test_murmura_peer_serves_its_dashboard_with_its_rounds(tmp_path: Path) -> None:
    # A peer has no run directory: the page shows its snapshot (role, round, its view) and
    # the rows of the rounds it has done, which it keeps for the page while it runs.
    with murmura("peer", "--listen", "127.0.0.1:0", "--rounds", "10000", "--local-steps", "1",
                 "--dashboard", "127.0.0.1:0", "-q", cwd=tmp_path) as proc:
        url = _url(proc, r"murmura dashboard on (http://127\.0\.0\.1:\d+/)")
        wait_until(lambda: len(_get_json(url + "api/metrics")["rows"]) >= 2
                   and _get_json(url + "api/snapshot")["version"] >= 2, timeout=60,
                   what="two rounds on the peer's page")
        snap, rows = _get_json(url + "api/snapshot"), _get_json(url + "api/metrics")["rows"]
        assert (snap["source"], snap["role"]) == ("live", "peer")
        assert snap["version"] >= 2 and isinstance(snap["peers"], list)
        assert [r["round"] for r in rows[:2]] == [1, 2] and "accuracy" in rows[0]
        proc.send_signal(signal.SIGTERM)  # graceful leave: it finishes the round and stops
        assert proc.wait(60) == 0
