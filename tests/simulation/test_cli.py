"""``murmura simulate``: murmura run's config file, flags over the file, same outputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from murmura.simulate import add_parser, simulate_file

CONFIG = """
[task]
task = "digits"
model = "logreg"
partition = "iid"

[server]
mode = "async"
max_versions = 6
buffer_size = 4
local_epochs = 1

[run]
clients = 12

[simulation]
speed_spread = 10.0
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="murmura")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_simulate_reads_murmura_runs_config_and_writes_the_run_outputs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    args = _parser().parse_args(["simulate", "--config", str(config), "--out", str(out),
                                 "--max-versions", "8", "--latency-ms", "5"])
    # Execute
    rc = args.fn(args)
    # Assert
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == 8  # the flag beats the file
    assert summary["config"]["simulation"]["clients"] == 12  # from [run]
    assert summary["config"]["server"]["mode"] == "async"
    assert summary["config"]["simulation"]["latency_ms"] == 5.0
    assert {"0", "1"} & set(summary["simulation"]["staleness_histogram"])
    for name in ("metrics.jsonl", "accuracy.png", "staleness.png"):
        assert (out / name).exists()
    printed = capsys.readouterr().out
    assert "execution: vmap" in printed and "virtual s" in printed


def test_simulate_file_is_the_same_from_python(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    result = simulate_file(config, out=str(tmp_path / "py"), clients=6, vectorise="off",
                           workers=1)
    assert result.execution_path == "loop"
    assert result.summary["config"]["simulation"]["clients"] == 6
    assert result.version == 6


def test_a_typo_in_the_config_is_an_error_that_names_it(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[simulation]\nclient = 3\n")
    args = _parser().parse_args(["simulate", "--config", str(config)])
    with pytest.raises(ValueError, match="unknown key 'client' in \\[simulation\\]"):
        args.fn(args)
    args = _parser().parse_args(["simulate", "--vectorise", "maybe"])
    with pytest.raises(ValueError, match="vectorise must be one of"):
        args.fn(args)


def test_simulate_runs_the_zeroth_order_trainer(tmp_path) -> None:
    args = _parser().parse_args(["simulate", "--trainer", "zo", "--codec", "seed",
                                 "--local-epochs", "0", "--local-steps", "5", "--clients", "3",
                                 "--max-versions", "1", "--workers", "1", "-q",
                                 "--out", str(tmp_path)])
    assert args.fn(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["versions"] == 1 and summary["updates"] == 3


def test_simulate_with_an_empty_out_says_it_wrote_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = _parser().parse_args(["simulate", "--task", "digits", "--model", "logreg",
                                 "--clients", "4", "--max-versions", "1", "--out", ""])
    assert args.fn(args) == 0
    assert "results: not written (--out '')" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
