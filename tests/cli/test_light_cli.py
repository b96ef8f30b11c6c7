"""``murmura --help``, a command's ``--help`` and an argument error answer without loading
torch (seconds on a small machine): the parser is built from config modules that import no
torch, and the commands import the heavy layers when they run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from murmura import catalog

#: Runs main(argv), then prints whether torch and numpy got imported and main's exit code.
_PROBE = """
import sys
from murmura.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("LOADED", "torch" in sys.modules, "numpy" in sys.modules, code, file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[bool, bool, str, subprocess.CompletedProcess[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True,
                          timeout=60)
    last = proc.stderr.strip().splitlines()[-1].split()
    assert last[0] == "LOADED", proc.stderr
    return last[1] == "True", last[2] == "True", last[3], proc


@pytest.mark.parametrize("argv", [
    ["--help"], ["run", "--help"], ["server", "--help"], ["client", "--help"],
    ["peer", "--help"], ["simulate", "--help"], ["launch", "--help"],
])
def test_help_loads_no_torch(argv: list[str]) -> None:
    torch, _, code, proc = _probe(*argv)
    assert code == "0" and "usage: murmura" in proc.stdout
    assert not torch


@pytest.mark.parametrize("argv", [["run", "--clients", "many"], ["run", "--no-such-flag"],
                                  ["no-such-command"]])
def test_argument_errors_load_no_torch(argv: list[str]) -> None:
    torch, _, code, proc = _probe(*argv)
    assert code == "2" and "murmura: error:" in proc.stderr
    assert not torch


def test_python_m_murmura_help_imports_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "murmura", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: murmura" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "murmura.cli" in imported and "torch" not in imported


def test_the_catalog_holds_what_the_registries_accept() -> None:
    """The names --help lists before torch is loaded are the registries' own (read in a fresh
    interpreter: tests in this one may have registered more)."""
    code = """
import json
from murmura.aggregation import available_aggregators, available_optimizers
from murmura.client.malicious import ATTACKS
from murmura.edge import AMP_MODES, DEVICES
from murmura.protocols.codecs import available_codecs
from murmura.tasks.registry import TASK_MODELS, TASKS
print(json.dumps([available_codecs(), available_aggregators(), available_optimizers(),
                  ATTACKS, DEVICES, AMP_MODES, sorted(TASKS) == sorted(TASK_MODELS)]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    codecs, rules, optimizers, attacks, devices, amp, tasks_match = json.loads(proc.stdout)
    assert sorted(catalog.BUILTIN_CODECS) == codecs
    assert sorted(catalog.BUILTIN_RULES) == rules
    assert sorted(catalog.BUILTIN_OPTIMIZERS) == optimizers
    assert list(catalog.ATTACKS) == attacks and list(catalog.DEVICES) == devices
    assert list(catalog.AMP_MODES) == amp
    assert tasks_match  # every bundled task has its loader and its models
