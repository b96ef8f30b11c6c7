"""The ``murmura`` command (and ``python -m murmura``): its parser and :func:`main`.

Each command lives in its own module: ``run`` (:mod:`murmura.run`), ``server``
(:mod:`murmura.serve`), ``client`` and ``launch`` (:mod:`murmura.clients`), ``peer``
(:mod:`murmura.peers`), ``simulate`` (:mod:`murmura.simulate`), ``keys`` and ``certs``
(:mod:`murmura.keys`), ``new`` (:mod:`murmura.new`), ``dashboard`` (:mod:`murmura.dashboard`).
Config flags come from the config dataclasses (:mod:`murmura.config`); every option is checked
before a command starts (:mod:`murmura.validate`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any

from murmura import __version__
from murmura.clients import add_flower_arguments, cmd_client, cmd_launch
from murmura.common import add_common
from murmura.config import add_arguments
from murmura.dashboard import add_dashboard_flags
from murmura.dashboard import add_parser as add_dashboard
from murmura.keys import cmd_certs, cmd_keys
from murmura.new import cmd_new
from murmura.run import RunConfig, cmd_run
from murmura.runs import cmd_runs
from murmura.serve import cmd_server
from murmura.validate import UsageError

__all__ = ["build_parser", "main"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` where the help line does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default is None \
                or action.default is False or action.default is argparse.SUPPRESS \
                or not action.option_strings:
            return text
        if action.default == "":
            return f"{text} (default: none)"
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``murmura: error: ...``, exit code 2) and help lines
    that show defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's own errors: unknown flag, bad int...
        self.exit(2, f"murmura: error: {message} (see {self.prog} --help)\n")


#: Server fields that make no sense for ``murmura run`` (its server and clients share loopback).
_SERVE_ONLY = ("tls_cert", "tls_key", "client_ca", "insecure", "key", "upstream_tls_ca",
               "upstream_tls_cert", "upstream_tls_key")


def build_parser() -> argparse.ArgumentParser:
    from murmura.client import ClientConfig
    from murmura.gossip import GossipConfig, PeerConfig
    from murmura.peers import cmd_peer
    from murmura.server import ServerConfig
    from murmura.tasks import TaskConfig

    parser = _Parser(prog="murmura", description=(
        "Federated and decentralized learning: an aggregator service, gRPC clients and a "
        "simulator sharing one code path."))
    parser.add_argument("--version", action="version", version=f"murmura {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="aggregator + N clients on loopback, end to end",
                       description="Start an aggregator and N client processes on loopback, "
                       "train the task, and write metrics, a summary and plots to --out.")
    add_common(p)
    add_arguments(p, RunConfig, title="run")
    add_arguments(p, TaskConfig, title="task")
    before = {a.dest for a in p._actions}
    add_arguments(p, ServerConfig, title="server", skip=("address", *_SERVE_ONLY))
    server = {a.dest for a in p._actions} - before
    add_arguments(p, GossipConfig, title="gossip (with --gossip)")
    gossip_only = {a.dest for a in p._actions} - before - server
    alone = argparse.ArgumentParser(add_help=False)  # every flag a gossip run reads
    add_arguments(alone, GossipConfig, title="gossip")
    server_only = server - {a.dest for a in alone._actions}  # --lr, --seed: both modes read
    p.add_argument("--device", default=None,
                   help="clients' device: auto, cpu, cuda, mps or cuda:N (default: auto)")
    add_flower_arguments(p, "run the clients and model of")
    add_dashboard_flags(p, tls=False)
    p.set_defaults(fn=cmd_run, server_only=sorted(server_only), gossip_only=sorted(gossip_only))

    p = sub.add_parser("server", help="run the aggregator service",
                       description="Serve the aggregator on --address until --max-versions "
                       "global versions exist or SIGINT/SIGTERM.")
    add_common(p)
    add_arguments(p, TaskConfig, title="task")
    add_arguments(p, ServerConfig, title="server")
    p.add_argument("--out", default="runs/server", metavar="DIR",
                   help="output directory: metrics.jsonl, summary.json, checkpoint.npz, "
                   "state.db")
    p.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="start from a checkpoint; 'auto' uses OUT/checkpoint.npz if present "
                   "(a durable OUT resumes from its state.db without this flag)")
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                   help="keep sessions, counted updates, counters and acknowledged updates in "
                   "OUT/state.db, acknowledge a push once it is on disk, and resume from OUT "
                   "after a crash or restart")
    p.add_argument("--linger-s", type=float, default=5.0,
                   help="after the last version, keep telling clients to stop for this many "
                   "seconds")
    add_flower_arguments(p, "serve the model of")
    add_dashboard_flags(p, tls=True)
    p.set_defaults(fn=cmd_server)

    p = sub.add_parser("client", help="run one client against an aggregator",
                       description="Join --server, train on this client's share of the task's "
                       "data, push updates until the server says stop.")
    add_common(p)
    add_arguments(p, ClientConfig, title="client")
    add_arguments(p, TaskConfig, title="task")
    p.add_argument("--run-key-seed", type=int, default=None, help=argparse.SUPPRESS)
    add_flower_arguments(p, "train with")
    p.set_defaults(fn=cmd_client)

    p = sub.add_parser("peer", help="run one gossip peer (no server)",
                       description="Serve the Peer service on --listen, join through any "
                       "--bootstrap peer, and train with the peers it finds: each round it "
                       "trains on its data share, sends its model to a few peers and mixes "
                       "what it receives (docs/gossip.md).")
    add_common(p)
    add_arguments(p, PeerConfig, title="peer")
    add_arguments(p, GossipConfig, title="gossip")
    add_arguments(p, TaskConfig, title="task")
    p.add_argument("--metrics-address", default="", metavar="HOST:PORT",
                   help="serve Prometheus metrics on HOST:PORT (port 0: any free port; needs "
                   "pip install \"murmura[ops]\"; docs/operations.md)")
    add_dashboard_flags(p, tls=False)
    p.set_defaults(fn=cmd_peer)

    p = sub.add_parser("runs", help="list the runs under a directory, or show one",
                       description="List the run directories under DIR (default: runs) with "
                       "their command, mode, state (running, finished, interrupted, crashed, "
                       "incomplete), versions, final accuracy and last change; `murmura runs "
                       "show NAME` prints one run's config, summary and last metrics rows "
                       "(docs/operations.md).")
    p.add_argument("target", nargs="*", metavar="DIR | show NAME",
                   help="the directory to list (default: runs), or `show NAME`")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="the directory holding the runs, for `show` (default: runs)")
    p.add_argument("--rows", type=int, default=5, metavar="N",
                   help="`show`: how many of the last metrics rows to print")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(fn=cmd_runs)

    p = sub.add_parser("new", help="write a starting app file NAME.py (docs/apps.md)",
                       description="Write NAME.py, an app file with a small model, generated "
                       "client data, a train function and comments on what else an app can "
                       "define; `murmura run --app NAME.py` runs it as it is.")
    p.add_argument("name", metavar="NAME", help="the app's name: writes NAME.py")
    p.add_argument("--dir", default=".", help="directory to write it in (default: .)")
    p.add_argument("--force", action="store_true", help="overwrite an existing NAME.py")
    p.set_defaults(fn=cmd_new)

    p = sub.add_parser("keys", help="node identity keys (Ed25519)",
                       description="Make a node identity: an Ed25519 key whose public key "
                       "gives the client id (docs/security.md).")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    k = keys.add_parser("new", help="a new key: FILE (private, 0600) and FILE.pub",
                        description="Write a new Ed25519 private key to --out (PEM, mode 0600) "
                        "and its public key in hex to OUT.pub (one line, the allow-list "
                        "format); print the client id.")
    k.add_argument("--out", required=True, metavar="FILE", help="where to write the private key")
    k.set_defaults(fn=cmd_keys)

    p = sub.add_parser("certs", help="a small CA and TLS certificates",
                       description="Make a certificate authority and server/client "
                       "certificates for TLS and mutual TLS (docs/security.md).")
    certs = p.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    c = certs.add_parser("init", help="a new CA: DIR/ca.crt and DIR/ca.key")
    c.add_argument("--out", required=True, metavar="DIR", help="directory for the CA's files")
    c = certs.add_parser("server", help="a server certificate signed by the CA")
    c.add_argument("--ca", required=True, metavar="DIR", help="the CA's directory (certs init)")
    c.add_argument("--host", default="localhost,127.0.0.1", metavar="NAME[,IP...]",
                   help="names and IP addresses clients use to reach the server")
    c.add_argument("--out", required=True, metavar="DIR",
                   help="directory for server.crt and server.key")
    c = certs.add_parser("client", help="a client certificate signed by the CA (mutual TLS)")
    c.add_argument("--ca", required=True, metavar="DIR", help="the CA's directory (certs init)")
    c.add_argument("--name", required=True, help="the client's name: NAME.crt and NAME.key")
    c.add_argument("--out", required=True, metavar="DIR", help="directory for the files")
    p.set_defaults(fn=cmd_certs)

    p = sub.add_parser("launch", help="N client processes per device, restarted on crashes",
                       description="Detect devices and start --clients-per-device client "
                       "processes on each against --server; restart crashed clients with "
                       "backoff and print a status table until every client is done.")
    add_common(p)
    p.add_argument("--server", required=True, help="the aggregator's HOST:PORT")
    p.add_argument("--clients-per-device", type=int, default=1,
                   help="client processes started on each device")
    p.add_argument("--devices", default="auto", help="auto, or a list: cuda:0,cuda:1,cpu")
    p.add_argument("--memory-fraction", type=float, default=0.0,
                   help="CUDA: cap each client at this share of its GPU (0: no cap)")
    p.add_argument("--client-index-start", type=int, default=0,
                   help="data share of the first client; the others follow")
    p.add_argument("--num-clients", type=int, default=0,
                   help="shares the data is split into (0: start + clients launched)")
    p.add_argument("--token", default="", help="join token, passed to every client")
    p.add_argument("--client-option", action="append", metavar="'--FLAG VALUE'",
                   help="repeatable: passed to every `murmura client`, e.g. '--codec int8'")
    p.add_argument("--work-dir", default="runs/launch",
                   help="client logs and status files")
    p.add_argument("--table-every-s", type=float, default=2.0,
                   help="print the status table every this many seconds")
    p.set_defaults(fn=cmd_launch)

    from murmura.simulate import add_parser as add_simulate

    add_simulate(sub)  # murmura simulate: same [task]/[server] config, virtual clock
    add_dashboard(sub)  # murmura dashboard --run DIR: a run's read-only web page
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def _did_you_mean(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """"; did you mean --x?" for the first unknown flag close to one of ``parser``'s."""
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.75)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def quiet_grpc_core() -> None:
    """Keep gRPC's C-core to its errors (unless ``GRPC_VERBOSITY`` is set): its info lines
    (a failed TLS handshake per connection try, for one) read like crashes, and the client
    names such failures itself. Read once, when gRPC starts: call before it is imported."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def main(argv: list[str] | None = None) -> int:
    quiet_grpc_core()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's help, and the flag a typo was probably meant to be
        command = _subcommand(parser, args.command)
        command.error(f"unrecognized arguments: {' '.join(extra)}"
                      + _did_you_mean(command, extra))
    from murmura.validate import validate

    try:
        validate(args)  # every option and config table, before anything starts
        return int(args.fn(args))
    except ValueError as exc:  # UsageError; configuration errors found later say the command
        text = " ".join(str(exc).split())
        where = "murmura: error:" if isinstance(exc, UsageError) else f"murmura {args.command}:"
        print(f"{where} {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
