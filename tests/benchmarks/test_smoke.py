"""Every benchmark script still runs: ``python benchmarks/<name>.py --smoke``, one test each.

A smoke run executes the script's own measurement code (its servers, codecs, load generators
and peers) at toy sizes, so a benchmark that drifts from the library fails here instead of
rotting unnoticed. The figures mean nothing; what is checked is that the script exits 0, that
its JSON report has the structure ``benchmarks/_report.py`` promises, and that it wrote
nothing committed (``benchmarks/results/`` and ``RESULTS.md`` are byte-for-byte unchanged).

Minutes in all, so kept out of the default run: ``python -m pytest -m bench``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
#: every script in benchmarks/, so a new benchmark is smoke-tested without editing this file
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
TIMEOUT_S = 600  # a smoke run takes seconds to a minute; this only catches a hang


def committed_outputs() -> dict[str, str]:
    """SHA-256 of every file a full run writes: results/* and RESULTS.md."""
    files = [BENCH / "RESULTS.md", *sorted((BENCH / "results").iterdir())]
    return {p.relative_to(BENCH).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files if p.is_file()}


def test_every_benchmark_is_listed() -> None:
    assert len(SCRIPTS) >= 16 and "durability" in SCRIPTS and "zo_memory" in SCRIPTS
    assert "soak" in SCRIPTS and "zo_speed" in SCRIPTS and "lm_finetune" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke(name: str, tmp_path: Path) -> None:
    before = committed_outputs()
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--smoke-dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    tail = "\n".join(done.stderr.strip().splitlines()[-40:])
    assert done.returncode == 0, f"{name} --smoke exited {done.returncode}; stderr tail:\n{tail}"

    assert committed_outputs() == before, f"{name} --smoke changed committed results"
    report_path = out / f"{name}.json"
    assert report_path.is_file(), f"{name} --smoke wrote no {report_path.name}; stderr:\n{tail}"
    report: dict[str, Any] = json.loads(report_path.read_text())
    assert report["benchmark"] == name
    assert report["smoke"] is True
    assert "(smoke" in done.stdout  # the printed report says so too

    rows = report["rows"]
    assert isinstance(rows, list) and rows, "no measured rows"
    assert all(isinstance(r, dict) and isinstance(r.get("table"), str) for r in rows)

    targets = report["targets"]
    assert isinstance(targets, list) and targets, "no targets"
    for t in targets:
        assert isinstance(t["name"], str) and t["name"]
        assert isinstance(t["value"], float), t  # NaN or inf where nothing was measured
        assert isinstance(t["goal"], str) and t["goal"].startswith((">= ", "<= ")), t
        assert isinstance(t["met"], bool)
        # met is computed from value and goal, not asserted
        assert t["met"] == (t["value"] >= t["threshold"] if t["op"] == ">="
                            else t["value"] <= t["threshold"]), t
    for plot in report["plots"]:  # plots land next to the JSON, never in results/
        assert Path(plot).parent == out, plot
