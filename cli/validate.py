"""Every option of a command checked in one place, before anything starts.

``murmura.cli.main`` calls :func:`validate` after argparse and before the command runs. It
reads the ``--config`` file, checks every table and key in it, then runs the checks registered
for the command (:func:`check`), in registration order. Each check builds the config
dataclasses the command will build (they validate themselves) and adds what they cannot know:
that a codec and its options instantiate, that an address parses and its port is free, that a
checkpoint to resume from is readable. Any problem is a :class:`UsageError` (a ``ValueError``):
``main`` prints it as one line, ``murmura: error: ...``, and exits with code 2.

A new option hooks in with a new check::

    @check("run", "server")
    def _app_file(args, toml):
        if args.app and not Path(args.app).is_file():
            raise UsageError(f"--app {args.app[:60]}: no such file")

and a new TOML table with :func:`register_table`. A check that loads something the other
checks look up (an app file registering aggregation rules or codecs) registers with
``@check(..., first=True)``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import inspect
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from murmura.config import build, known_keys, read_toml

__all__ = ["TABLES", "UsageError", "check", "check_address", "check_codec", "check_port_free",
           "check_rule", "check_tables", "register_table", "validate"]


class UsageError(ValueError):
    """A bad option, config value or input file; the message is one line saying what and
    what was expected."""


#: TOML table -> "module:Class" of the config dataclass it configures. Every table of a
#: config file is checked against its class, whichever command reads the file, so one file
#: serves run, server, client and simulate and a typo is caught by any of them.
TABLES: dict[str, str] = {
    "task": "murmura.tasks:TaskConfig",
    "server": "murmura.server:ServerConfig",
    "client": "murmura.client:ClientConfig",
    "run": "murmura.run:RunConfig",
    "simulation": "murmura.simulation.config:SimulationConfig",
    "gossip": "murmura.gossip:GossipConfig",
    "peer": "murmura.gossip:PeerConfig",
}

Check = Callable[[argparse.Namespace, dict[str, Any]], None]
_CHECKS: dict[str, list[Check]] = {}


def register_table(name: str, cls_path: str) -> None:
    """Accept a ``[name]`` table configuring the dataclass at ``"module:Class"``."""
    if name in TABLES and TABLES[name] != cls_path:
        raise ValueError(f"table [{name}] is already registered for {TABLES[name]}")
    TABLES[name] = cls_path


def check(*commands: str, first: bool = False) -> Callable[[Check], Check]:
    """Decorator: run ``fn(args, toml)`` before ``murmura COMMAND`` starts, for each command.

    Checks run in registration order; ``first`` puts ``fn`` before those already registered,
    for an option whose loading registers names the others check (an app file's rules or
    codecs).
    """
    def register(fn: Check) -> Check:
        for command in commands:
            checks = _CHECKS.setdefault(command, [])
            checks.insert(0 if first else len(checks), fn)
        return fn
    return register


def _load(cls_path: str) -> type:
    module, _, name = cls_path.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Check ``args`` and its config file for ``args.command``; return the parsed TOML.

    Raises :class:`UsageError` on the first problem.
    """
    try:
        toml = read_toml(getattr(args, "config", None))
        check_tables(toml, getattr(args, "config", None) or "")
        for fn in _CHECKS.get(args.command, []):
            fn(args, toml)
    except UsageError:
        raise
    except (ValueError, KeyError, TypeError) as exc:  # a config's own check: say it as is
        raise UsageError(_one_line(exc)) from None
    return toml


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split())


def check_tables(toml: dict[str, Any], path: str = "") -> None:
    """Every table of the file is known and every key in it names a field."""
    where = f"config file {path}: " if path else ""
    for table, value in toml.items():
        if table not in TABLES:
            raise UsageError(f"{where}unknown table [{table[:40]}]; valid tables: "
                             f"{', '.join(f'[{t}]' for t in sorted(TABLES))}")
        if not isinstance(value, dict):
            raise UsageError(f"{where}{table} must be a table ([{table}]), got a "
                             f"{type(value).__name__}")
        _check_keys(_load(TABLES[table]), value, table, where)


def _check_keys(cls: type, table: dict[str, Any], name: str, where: str) -> None:
    top, nested = known_keys(cls)
    for key, value in table.items():
        if key in nested and isinstance(value, dict):
            _check_keys(nested[key], value, f"{name}.{key}", where)
        elif key not in top:
            raise UsageError(f"{where}unknown key {key[:40]!r} in [{name}]; valid keys: "
                             f"{', '.join(sorted(top))}")


# -- reusable checks --------------------------------------------------------------------------

def check_address(value: str, what: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a port in 0..65535; returns (host, port)."""
    shown = f"{value[:60]!r}"
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise UsageError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:50051), got {shown}")
    port = int(port_text)
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise UsageError(f"{what}: port {port} is outside "
                         f"{'0' if allow_port_zero else '1'}..65535 in {shown}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise UsageError(f"{what}: unclosed IPv6 bracket in {shown}")
        host = host[1:-1]
    elif ":" in host or any(c.isspace() for c in host):
        raise UsageError(f"{what} must be HOST:PORT (IPv6 as [ADDR]:PORT), got {shown}")
    return host, port


def check_port_free(value: str, what: str) -> None:
    """Fail now when ``value``'s port is already taken (port 0 is always free)."""
    host, port = check_address(value, what)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if host in ("0.0.0.0", "::", "*") else host
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            s.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"{what}: port {port} is already in use on {host} (another "
                                 f"server running? pick another port, or 0 for any free "
                                 f"one)") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UsageError(f"{what}: {host[:60]} is not an address of this "
                                 f"machine") from None
            if exc.errno == errno.EACCES:
                raise UsageError(f"{what}: no permission to bind port {port} (ports below "
                                 f"1024 need privileges)") from None
            raise UsageError(f"{what}: cannot bind {value[:60]}: {exc.strerror}") from None
        except socket.gaierror:
            raise UsageError(f"{what}: unknown host {host[:60]!r}") from None


def check_codec(name: str, options: dict[str, str], what: str = "codec",
                *, client: bool = False) -> None:
    """The codec is registered and its options instantiate it (``client``: ``""`` and
    ``auto`` are valid too: the server's choice, or picked from the link)."""
    from murmura.protocols.codecs import available_codecs, create_codec

    if client and name in ("", "auto"):
        return
    if name not in available_codecs():
        extra = ", auto (or empty: the server's)" if client else ""
        raise UsageError(f"unknown {what} {name[:40]!r}; valid codecs: "
                         f"{', '.join(available_codecs())}{extra}")
    try:
        create_codec(name, options)
    except (ValueError, TypeError) as exc:  # CodecError is a ValueError
        raise UsageError(f"--codec-option: {_one_line(exc)}") from None


def check_rule(name: str, options: dict[str, Any], what: str, option_flag: str) -> None:
    """The aggregation rule is registered, each option is one of its keyword parameters with
    a value of the parameter's type, and the rule builds with them."""
    from murmura.aggregation import AggregationError, available_aggregators, create_aggregator
    from murmura.aggregation.base import aggregator_factory

    if name not in available_aggregators():
        raise UsageError(f"unknown {what} {name[:40]!r}; valid rules: "
                         f"{', '.join(available_aggregators())}")
    params = _keyword_params(aggregator_factory(name))
    for key, value in options.items():
        if params is None:
            break
        if key not in params:
            valid = ", ".join(params) or "none"
            raise UsageError(f"{option_flag}: rule {name!r} has no option {key[:40]!r}; its "
                             f"options: {valid}")
        expected = params[key]
        if not _fits(value, expected):
            raise UsageError(f"{option_flag}: rule {name!r} option {key}="
                             f"{str(value)[:40]!r} is not {_kind(expected)}")
    try:
        create_aggregator(name, 16, **options)
    except (AggregationError, ValueError, TypeError) as exc:
        raise UsageError(f"{option_flag}: rule {name!r}: {_one_line(exc)}") from None


def _keyword_params(factory: Any) -> dict[str, str] | None:
    """Keyword parameter name -> annotation text (None: the factory takes ``**kwargs``)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    out = {}
    for p in list(signature.parameters.values())[1:]:  # the first is the vector size
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            out[p.name] = str(p.annotation)
    return out


def _fits(value: Any, annotation: str) -> bool:
    if value is None:
        return "None" in annotation or annotation == str(inspect.Parameter.empty)
    if "bool" in annotation:
        return isinstance(value, (bool, int)) or str(value).lower() in ("true", "false")
    if "int" in annotation and "float" not in annotation:
        return isinstance(value, int) and not isinstance(value, bool)
    if "float" in annotation:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _kind(annotation: str) -> str:
    if "bool" in annotation:
        return "true or false"
    if "int" in annotation and "float" not in annotation:
        return "an integer" + (" (or none)" if "None" in annotation else "")
    if "float" in annotation:
        return "a number" + (" (or none)" if "None" in annotation else "")
    return f"a {annotation}"


def check_checkpoint(path: str, what: str = "--resume") -> None:
    """The checkpoint exists and reads whole (a truncated or corrupted file fails now)."""
    from murmura.server.checkpoint import load_checkpoint

    if not Path(path).is_file():
        raise UsageError(f"{what}: no checkpoint file at {path[:80]}")
    try:
        load_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the same answer
        reason = _one_line(exc).split(": ")[-1][:80]
        raise UsageError(f"{what}: {path[:80]} is not a readable Murmura checkpoint "
                         f"(truncated or corrupted: {reason})") from None


# -- per-command checks -----------------------------------------------------------------------

def _server_side(args: argparse.Namespace, toml: dict[str, Any], **overrides: Any) -> Any:
    """The task and server configs as the command builds them; the codec and the rule (with
    their options) are checked first, for messages that name the flags."""
    from murmura.server import ServerConfig
    from murmura.tasks import TaskConfig

    _early_codec_and_rule(args, toml)
    build(TaskConfig, toml.get("task"), args, section="task")
    return build(ServerConfig, toml.get("server"), args, section="server", overrides=overrides)


def _early_codec_and_rule(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    """--codec/--codec-option and --defense/--defense-option from the flags or the file."""
    from murmura.protocols.options import parse_options

    server = toml.get("server", {})
    train = server.get("train", {}) if isinstance(server.get("train"), dict) else {}

    def given(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        if value is None:
            value = train.get(name, server.get(name, default))
        return value

    codec = str(given("codec", "dense-f32"))
    check_codec(codec, _options(given("codec_options", {}), "--codec-option"))
    defense = str(given("defense", "fedavg"))
    options = parse_options(_options(given("defense_options", {}), "--defense-option"))
    check_rule(defense, options, "defense", "--defense-option")


def _options(value: Any, flag: str) -> dict[str, str]:
    """KEY=VALUE flags (a list) or a TOML table (a dict) as a dict of strings."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    out = {}
    for item in value or ():
        key, sep, val = str(item).partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag} expects KEY=VALUE, got {str(item)[:40]!r}")
        out[key.strip()] = val.strip()
    return out


@check("run")
def _run(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    from murmura.run import RunConfig

    run = build(RunConfig, toml.get("run"), args, section="run")
    if run.gossip:
        _gossip(args, toml)
        return
    _server_side(args, toml, address="127.0.0.1:0")
    _device(getattr(args, "device", None))


@check("server")
def _server(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    check_address(_given(args, toml, "server", "address", "127.0.0.1:0"), "--address")
    server = _server_side(args, toml)
    if server.leaf.upstream:
        check_address(server.leaf.upstream, "--upstream", allow_port_zero=False)
    check_port_free(server.address, "--address")
    resume = getattr(args, "resume", None)
    if resume == "auto":
        candidate = Path(args.out) / "checkpoint.npz"
        if candidate.exists() and not (args.durable and (Path(args.out) / "state.db").exists()):
            check_checkpoint(str(candidate), "--resume auto")
    elif resume:
        check_checkpoint(resume)


@check("client")
def _client(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    from murmura.client import ClientConfig
    from murmura.tasks import TaskConfig

    check_address(_given(args, toml, "client", "server", "127.0.0.1:50051"), "--server",
                  allow_port_zero=False)
    cfg = build(ClientConfig, toml.get("client"), args, section="client")
    build(TaskConfig, toml.get("task"), args, section="task")
    check_codec(cfg.codec, {}, "--codec", client=True)
    if cfg.give_up_after_s < 0:
        raise UsageError(f"--give-up-after-s must be >= 0, got {cfg.give_up_after_s}")
    if cfg.give_up_unreached_s < 0:
        raise UsageError(f"--give-up-unreached-s must be >= 0, got {cfg.give_up_unreached_s}")


@check("peer")
def _peer(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    from murmura.gossip import PeerConfig

    check_address(_given(args, toml, "peer", "listen", "127.0.0.1:0"), "--listen")
    for b in _given(args, toml, "peer", "bootstrap", "").split(","):
        if b.strip():
            check_address(b, "--bootstrap", allow_port_zero=False)
    cfg = build(PeerConfig, toml.get("peer"), args, section="peer")
    check_port_free(cfg.listen, "--listen")
    _gossip(args, toml)


def _gossip(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    from murmura.gossip import GossipConfig
    from murmura.protocols.options import parse_options
    from murmura.tasks import TaskConfig

    build(TaskConfig, toml.get("task"), args, section="task")
    gossip = build(GossipConfig, toml.get("gossip"), args, section="gossip")
    options = parse_options(gossip.rule_options)
    check_rule(gossip.rule, options, "gossip rule", "--rule-option")


@check("simulate")
def _simulate(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    from murmura.simulate import load_configs

    _early_codec_and_rule(args, toml)
    _, server, sim, _ = load_configs(toml, args)
    if sim.gossip:
        _gossip(args, toml)
        return
    from murmura.simulation.api import prepare_server

    prepare_server(server, sim)  # the simulator's own limits (no zeroth-order trainer)


@check("launch")
def _launch(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    check_address(args.server, "--server", allow_port_zero=False)
    if args.clients_per_device < 1:
        raise UsageError(f"--clients-per-device must be >= 1, got {args.clients_per_device}")


def _given(args: argparse.Namespace, toml: dict[str, Any], table: str, name: str,
           default: str) -> str:
    value = getattr(args, name, None)
    if value is None:
        value = toml.get(table, {}).get(name, default)
    return str(value)


def _device(device: str | None) -> None:
    from murmura.edge import DEVICES

    if device and device not in DEVICES and not device.startswith("cuda:"):
        raise UsageError(f"--device must be one of {', '.join(DEVICES)} or cuda:N, got "
                         f"{device[:20]!r}")


@check("run", "server", "client", "simulate", "peer", first=True)
def _app(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    """An app file first: importing it registers its aggregation rules, which the rule
    checks below then find (``--defense my-rule``)."""
    app = getattr(args, "app", None) or (toml.get("task") or {}).get("app")
    if app:
        from murmura.tasks.app import load_app

        load_app(app)
