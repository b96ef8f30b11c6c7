"""`murmura server --role leaf` end to end: a top, a leaf and two clients, each its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from murmura.cli import main

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _murmura(*args: str, **kw) -> subprocess.Popen[str]:  # noqa: ANN003
    return subprocess.Popen([sys.executable, "-m", "murmura", *args], text=True, env=ENV,
                            stdin=subprocess.DEVNULL, **kw)


def _address(proc: subprocess.Popen[str]) -> str:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert "listening on 127.0.0.1:" in line, line
    return line.split("listening on ", 1)[1].split()[0]


@pytest.mark.integration
@pytest.mark.slow
def test_clients_train_through_a_leaf_process(tmp_path: Path) -> None:
    assert main(["keys", "new", "--out", str(tmp_path / "site-a.key")]) == 0
    top = _murmura("server", "--address", "127.0.0.1:0", "--min-clients", "1",
                   "--max-versions", "2", "--local-epochs", "1", "--linger-s", "1",
                   "--leaf-keys", str(tmp_path / "site-a.key.pub"),
                   "--out", str(tmp_path / "top"), stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    procs = [top]
    try:
        top_address = _address(top)
        leaf = _murmura("server", "--role", "leaf", "--upstream", top_address, "--name",
                        "site-a", "--address", "127.0.0.1:0", "--min-clients", "2",
                        "--key", str(tmp_path / "site-a.key"),
                        "--linger-s", "1", "--out", str(tmp_path / "leaf"),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(leaf)
        leaf_address = _address(leaf)
        clients = [_murmura("client", "--server", leaf_address, "--client-index", str(i),
                            "--num-clients", "2",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                   for i in range(2)]
        procs += clients
        for c in clients:
            out, _ = c.communicate(timeout=240)
            assert c.returncode == 0, out
        top_out, top_err = top.communicate(timeout=120)
        assert top.returncode == 0, top_err
        leaf_out, leaf_err = leaf.communicate(timeout=120)
        assert leaf.returncode == 0, leaf_err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rows = [json.loads(x) for x in (tmp_path / "top" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["updates_in_version"] == 2 for r in rows)  # each partial holds both clients
    assert rows[-1]["accuracy"] > 0.3


def test_leaf_and_backend_mistakes_are_one_line_errors(capsys) -> None:
    assert main(["server", "--role", "leaf"]) == 2
    assert "needs upstream HOST:PORT" in capsys.readouterr().err
    assert main(["server", "--role", "leaf", "--upstream", "127.0.0.1:1", "--defense",
                 "median"]) == 2
    assert "decomposable" in capsys.readouterr().err
    assert main(["server", "--accumulator", "exactish"]) == 2
    assert "accumulator must be one of" in capsys.readouterr().err
    assert main(["server", "--workers", "-2"]) == 2
    assert "workers must be" in capsys.readouterr().err
    assert main(["server", "--ray-address", "10.0.0.1:6379"]) == 2
    assert "only for backend 'ray'" in capsys.readouterr().err


def test_backend_ray_without_ray_installed_names_the_extra(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(["server", "--backend", "ray"]) == 2
    assert 'pip install "murmura[ray]"' in capsys.readouterr().err
