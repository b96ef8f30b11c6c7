"""Errors a new user hits name their cause in one line, exit 2 and end soon: a TLS mismatch, a
server never reached, a key file in a missing directory, an app's train() without
num_examples (in `murmura run`, naming the client's log), an unknown attack option."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from murmura.cli import build_parser, main
from murmura.client.malicious import ATTACK_OPTIONS, make_attack


def murmura(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real command, with gRPC's verbosity left to it (as a user's shell would)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    return subprocess.run([sys.executable, "-m", "murmura", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL)


def one_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


# -- TLS mismatch, server never reached -------------------------------------------------------



@pytest.mark.integration
@pytest.mark.parametrize("server_tls, client_flags, fragment", [
    (True, [], "speaks TLS; pass --tls-ca"),
    (False, ["--tls-ca", "{ca}"], "is plaintext; drop --tls-ca"),
])
def test_a_tls_mismatch_is_named_in_one_line_without_grpc_log_lines_and_ends_soon(
        serve_tiny, pki, tmp_path: Path, server_tls: bool, client_flags: list[str],
        fragment: str) -> None:
    tls = {"tls_cert": str(pki["cert"]), "tls_key": str(pki["key"])} if server_tls else {}
    srv = serve_tiny(**tls)
    flags = [f.format(ca=pki["ca"]) for f in client_flags]
    t0 = time.monotonic()
    proc = murmura("client", "--server", srv.address, *flags, cwd=tmp_path, timeout=60)
    assert time.monotonic() - t0 < 30  # not --give-up-after-s (300 s)
    err = one_line(proc, f"the server at {srv.address} {fragment}")
    assert err.startswith("murmura client: ")
    assert "ssl_transport_security" not in proc.stderr and "Handshake failed" not in proc.stderr


@pytest.mark.integration
@pytest.mark.slow  # the client loads its data before the runtime's last try
def test_a_client_that_never_reached_its_server_exits_after_give_up_unreached_s(
        tmp_path: Path) -> None:
    with socket.socket() as sock:  # bound, never listening: connection refused
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        proc = murmura("client", "--server", address, "--give-up-unreached-s", "1", "-q",
                       cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    *early, last = proc.stderr.strip().splitlines()
    reason = f"cannot reach the aggregator at {address} (connection refused)"
    assert last.startswith(f"murmura client: {reason}"), last
    assert last.endswith("gave up after 1 s without ever reaching it (--give-up-unreached-s)")
    assert len(early) <= 1 and all(f"WARNING murmura.client.transport: {reason}" in line
                                   for line in early)  # said at the first try, once


def test_give_up_unreached_s_has_help_and_a_default_of_30_s() -> None:
    parser = build_parser()
    client = next(a for a in parser._actions if a.dest == "command").choices["client"]
    action = next(a for a in client._actions if "--give-up-unreached-s" in a.option_strings)
    assert "--give-up-after-s" in (action.help or "") and "(default: 30.0)" in (action.help or "")
    from murmura.client import ClientConfig

    assert ClientConfig().give_up_unreached_s == 30.0


# -- murmura keys new into a missing directory ------------------------------------------------

def test_keys_new_creates_the_directory_of_out(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["keys", "new", "--out", "keys/x.key"]) == 0
    assert (tmp_path / "keys" / "x.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "keys" / "x.key.pub").exists()
    assert "wrote keys/x.key" in capsys.readouterr().out
    assert main(["keys", "new", "--out", "keys/x.key"]) == 2  # never overwritten
    assert capsys.readouterr().err.strip() == ("murmura keys: keys/x.key already exists; not "
                                               "overwriting a key")
    (tmp_path / "file").write_text("")
    assert main(["keys", "new", "--out", "file/x.key"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot create the directory of --out" in err


# -- an app whose train() returns no num_examples ---------------------------------------------

@pytest.fixture
def bad_app(tmp_path: Path, capsys) -> Path:
    """`murmura new`'s app, with train() returning no num_examples."""
    assert main(["new", "badapp", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    app = tmp_path / "badapp.py"
    text = app.read_text()
    assert 'return {"num_examples": len(y)}' in text
    app.write_text(text.replace('return {"num_examples": len(y)}', 'return {"loss": 1.0}'))
    return app


CAUSE = "app badapp.py: train() must return a positive 'num_examples'"


@pytest.mark.integration
@pytest.mark.slow  # two forked client processes import and load their data
def test_run_names_a_failing_clients_cause_and_its_log_in_one_line(bad_app: Path,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = murmura("run", "--app", str(bad_app), "--clients", "2", "--max-versions", "2",
                   "--out", str(out), "-q", cwd=tmp_path)
    log = out / "clients" / "client-000.log"
    one_line(proc, f"murmura run: 2 of 2 clients failed; client 0: {CAUSE}",
             f"(its log: {log})")
    assert f"murmura client: {CAUSE}" in log.read_text()  # its last line: what run reports


@pytest.mark.integration
def test_run_in_process_names_a_failing_clients_cause_without_a_traceback(
        bad_app: Path, tmp_path: Path) -> None:
    proc = murmura("run", "--app", str(bad_app), "--clients", "2", "--max-versions", "2",
                   "--out", str(tmp_path / "out"), "--in-process", "-q", cwd=tmp_path)
    one_line(proc, f"murmura run: 2 of 2 client threads failed; client 0: {CAUSE}")


# -- attack options ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["client", "peer"])
def test_an_unknown_attack_option_names_the_valid_ones(command: str, capsys) -> None:
    assert main([command, "--attack", "scale", "--attack-option", "scale=10"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "attack 'scale': unknown option 'scale'; its options: factor" in err


@pytest.mark.parametrize("command", ["client", "peer"])
def test_the_attack_option_help_names_every_option_and_its_example_works(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = " ".join(next(a for a in sub._actions if a.dest == "attack_options").help.split())
    for attack, names in ATTACK_OPTIONS.items():
        if attack:
            assert f"{attack} {', '.join(names)}" in text, (attack, text)
    example = re.search(r"--attack (\S+) --attack-option (\w+)=(\S+?)\)", text)
    assert example is not None, text
    make_attack(example[1], {example[2]: example[3]})  # the help's own example is valid


def test_an_attack_without_options_says_so() -> None:
    with pytest.raises(ValueError, match="unknown options 'a', 'b'; it takes no options"):
        make_attack("", {"a": "1", "b": "2"})
