"""``--flower-app`` on ``murmura server`` and ``murmura client``: a real run through processes,
and one-line errors for values that cannot be a Flower client."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from murmura.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower_client.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

# examples/flower_client.py, which these tests run, reads scikit-learn's digits (dev extra).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                reason="examples/flower_client.py needs scikit-learn")


def _murmura(*args: str, env: dict[str, str] | None = None,
             **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "murmura", *args], text=True,
                            env=env or ENV, stdin=subprocess.DEVNULL, **kw)  # type: ignore


@pytest.mark.integration
@pytest.mark.slow
def test_server_and_client_processes_run_a_flower_client(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with open(tmp_path / "server.log", "w") as err:
        server = _murmura("server", "--flower-app", f"{EXAMPLE}:client_fn", "--min-clients",
                          "1", "--max-versions", "2", "--workers", "0", "--local-epochs", "1",
                          "--batch-size", "32", "--linger-s", "1", "--out", str(out),
                          stdout=subprocess.PIPE, stderr=err)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert "listening on 127.0.0.1:" in line, (tmp_path / "server.log").read_text()
        address = line.split("listening on ", 1)[1].split()[0]
        # the module form: flower_client importable from PYTHONPATH
        client = _murmura("client", "--server", address, "--flower-app",
                          "flower_client:DigitsClient", env={**ENV, "PYTHONPATH": str(
                              EXAMPLE.parent)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
        text, _ = client.communicate(timeout=240)
        assert client.returncode == 0, text
        assert "2 updates pushed" in text, text
        server.communicate(timeout=60)
        assert server.returncode == 0
    finally:
        for p in (server,):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows][-1] == 2
    assert rows[-1]["accuracy"] > 0.3  # the initial model is at chance (about 0.1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["flower_app"].endswith("flower_client.py:client_fn")


@pytest.mark.parametrize("value, message", [
    ("no_such_module_xyz:client_fn", "no module named 'no_such_module_xyz'"),
    (f"{EXAMPLE}:nope", "has no attribute 'nope'"),
    (f"{EXAMPLE}:make_model", "'make_model' is a function; expected a Flower NumPyClient"),
    ("client_fn", "--flower-app must be MODULE:ATTR, FILE.py:ATTR or an app directory"),
    ("missing/file.py:app", "no such file 'missing/file.py'"),
])
@pytest.mark.parametrize("command", ["client", "server"])
def test_a_bad_flower_app_is_a_one_line_error(command: str, value: str, message: str,
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    extra = (["--server", "127.0.0.1:1"] if command == "client"
             else ["--out", str(tmp_path / "out")])
    assert main([command, "--flower-app", value, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"murmura {command}: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)
    if command == "server":
        assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_process_exits_2_without_a_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "murmura", "client", "--flower-app",
                           "no_such_module_xyz:app"], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "murmura client: no module named 'no_such_module_xyz' (give an importable module or "
        "a path to a .py file)")
