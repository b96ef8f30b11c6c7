"""Every bad option of issue 13 gets one line on stderr, exit code 2, no traceback, and
nothing starts (subprocess tests of the real command)."""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from murmura.cli import main
from murmura.server.checkpoint import Checkpoint, save_checkpoint


def murmura(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "murmura", *argv], capture_output=True,
                          text=True, timeout=120, cwd=cwd, stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1, err
    assert err.startswith("murmura: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def checkpoint(path: Path) -> Path:
    params = np.arange(5000, dtype=np.float32)
    save_checkpoint(path, Checkpoint(version=3, params=params, spec_fingerprint="abc"))
    return path


#: The cases issue 13 lists, each run as its own `python -m murmura` process. They start
#: together (two at a time) in one fixture; each pays for its imports (torch).
ISSUE_CASES: dict[str, tuple[list[str], list[str]]] = {
    "run --codec foo": (["run", "--codec", "foo", "--out", "{out}"],
                        ["unknown codec 'foo'", "dense-f32", "topk"]),
    "run bad --codec-option": (["run", "--codec", "topk", "--codec-option", "ratio=2",
                                "--out", "{out}"], ["--codec-option", "ratio"]),
    "simulate --codec foo": (["simulate", "--codec", "foo", "--out", "{out}"],
                             ["unknown codec 'foo'"]),
    "bad --defense-option value": (["run", "--defense", "trimmed-mean", "--defense-option",
                                    "trim=abc", "--out", "{out}"],
                                   ["--defense-option", "trimmed-mean", "trim='abc' is not a "
                                    "number"]),
    "bad --defense-option name": (["run", "--defense", "krum", "--defense-option", "zz=1",
                                   "--out", "{out}"],
                                  ["--defense-option", "krum", "no option 'zz'", "options: f"]),
    "server bad --address": (["server", "--address", "localhost:http", "--out", "{out}"],
                             ["--address must be HOST:PORT", "localhost:http"]),
    "client bad --server": (["client", "--server", "nohost"], ["--server must be HOST:PORT"]),
    "port taken": (["server", "--address", "127.0.0.1:{port}", "--out", "{out}"],
                   ["port {port} is already in use"]),
    "truncated checkpoint": (["server", "--resume", "{truncated}", "--out", "{out}"],
                             ["--resume", "truncated.npz is not a readable Murmura checkpoint"]),
    "corrupted checkpoint": (["server", "--resume", "{corrupted}", "--out", "{out}"],
                             ["--resume", "corrupted.npz is not a readable Murmura "
                              "checkpoint"]),
    "unknown TOML table": (["simulate", "--config", "{toml}", "--out", "{out}"],
                           ["unknown table [srever]", "valid tables: ", "[server]"]),
}


@pytest.fixture(scope="module")
def issue_results(tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, tuple[subprocess.CompletedProcess[str], dict[str, str]]]:
    root = tmp_path_factory.mktemp("bad-input")
    truncated = checkpoint(root / "truncated.npz")
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    corrupted = checkpoint(root / "corrupted.npz")
    data = bytearray(corrupted.read_bytes())
    middle = len(data) // 2  # inside the params array: the zip CRC no longer matches
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    corrupted.write_bytes(bytes(data))
    toml = root / "c.toml"
    toml.write_text('[srever]\nmode = "async"\n')
    with socket.socket() as taken:  # held until every process has answered
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        values = {"truncated": str(truncated), "corrupted": str(corrupted), "toml": str(toml),
                  "port": str(taken.getsockname()[1])}

        def one(case: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
            argv, _ = ISSUE_CASES[case]
            names = dict(values, out=str(root / case.replace(" ", "_") / "out"))
            (root / case.replace(" ", "_")).mkdir()
            return murmura(*(a.format(**names) for a in argv), cwd=root), names

        with ThreadPoolExecutor(max_workers=2) as pool:
            return dict(zip(ISSUE_CASES, pool.map(one, ISSUE_CASES), strict=True))


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_issue_case_is_one_line_exit_2_and_starts_nothing(case: str, issue_results) -> None:
    proc, names = issue_results[case]
    assert_one_line_error(proc, *(f.format(**names) for f in ISSUE_CASES[case][1]))
    assert not Path(names["out"]).exists()  # nothing started, nothing written


#: More bad input, through main() in this process (the same code path, without the imports).
MORE_CASES = {
    "run unknown --codec-option": (["run", "--codec", "int8", "--codec-option", "zz=1"],
                                   ["--codec-option", "zz"]),
    "--codec-option without =": (["run", "--codec-option", "ratio"],
                                 ["--codec-option expects KEY=VALUE"]),
    "unknown --defense": (["simulate", "--defense", "krun"], ["unknown defense 'krun'", "krum"]),
    "server --address port out of range": (["server", "--address", "127.0.0.1:70000"],
                                           ["port 70000"]),
    "client --codec foo": (["client", "--codec", "foo"], ["unknown --codec 'foo'", "auto"]),
    "peer bad --bootstrap": (["peer", "--bootstrap", "127.0.0.1:1,nohost"],
                             ["--bootstrap must be HOST:PORT"]),
    "gossip unknown --rule": (["run", "--gossip", "--rule", "avg"], ["unknown gossip rule"]),
    # flags the chosen mode would ignore (--rounds used to run the server's 30 versions)
    "run --rounds without --gossip": (["run", "--rounds", "5"],
                                      ["--rounds: gossip option", "--max-versions"]),
    "run --gossip with aggregator flags": (
        ["run", "--gossip", "--defense", "median", "--max-versions", "3"],
        ["--defense, --max-versions: aggregator options", "--rounds", "--rule"]),
    "launch bad --server": (["launch", "--server", "a:b"], ["--server must be HOST:PORT"]),
    "compass min steps above max": (
        ["server", "--mode", "compass", "--compass-min-steps", "5", "--compass-max-steps", "2"],
        ["compass_min_steps 5 and compass_max_steps 2"]),
    "simulate zo trainer on ray": (["simulate", "--trainer", "zo", "--codec", "seed",
                                    "--executor", "ray"], ["zeroth-order trainer runs in"]),
}


@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_more_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, capsys,
                                               monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv, fragments = MORE_CASES[case]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("murmura: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_argparse_errors_are_one_line_too() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--clients", "many"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("argv, fragments", [
    (["server", "--port", "99"], ["unrecognized arguments: --port 99",
                                  "(see murmura server --help)"]),
    (["simulate", "--clients=5", "--max-version", "3", "--gosip"],
     ["unrecognized arguments: --gosip", "did you mean --gossip?", "murmura simulate --help"]),
    (["run", "stray"], ["unrecognized arguments: stray", "(see murmura run --help)"]),
])
def test_an_unknown_flag_names_the_subcommand_help_and_the_likely_flag(
        argv: list[str], fragments: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("murmura: error: "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("toml, fragments", [
    ("[server.train]\ncodek = 'int8'\n", ["unknown key 'codek' in [server.train]", "codec"]),
    ("[client]\nservr = '127.0.0.1:1'\n", ["unknown key 'servr' in [client]"]),
    ("task = 'digits'\n", ["task must be a table"]),
    ("[server]\ndefense_options = {zz = 1}\ndefense = 'krum'\n", ["no option 'zz'"]),
    ("[server.train]\ncodec = 'nope'\n", ["unknown codec 'nope'"]),
])
def test_config_file_tables_and_keys_are_checked(toml: str, fragments: list[str],
                                                 tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    # a table another command reads is checked too: one file serves every command
    assert main(["simulate", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("murmura: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "o").exists()
