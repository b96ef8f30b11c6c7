"""``murmura dashboard --run DIR``, and ``--dashboard ADDR`` for ``murmura server`` and
``murmura run``: a read-only web page of a run (docs/operations.md, "Dashboard").

The page is served from its own thread (:class:`murmura.server.dashboard.DashboardServer`).
Beside a live aggregator, a task on the aggregator's own event loop posts the telemetry's
snapshot to it twice a second (:func:`start_live`); the dashboard reads only what was posted.
Starlette and uvicorn are the optional ``ops`` extra; without them the command says what to
install and exits 2. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from murmura.common import VERBOSE_HELP, configure_logging
from murmura.validate import UsageError, check, check_port_free

log = logging.getLogger("murmura")

__all__ = ["LiveDashboard", "add_dashboard_flags", "add_parser", "cmd_dashboard", "start_live"]

#: Where the token may come from instead of the command line (which ``ps`` shows).
TOKEN_ENV = "MURMURA_DASHBOARD_TOKEN"
DEFAULT_ADDRESS = "127.0.0.1:8080"
#: How often a live aggregator posts its snapshot to the dashboard.
POST_EVERY_S = 0.5
INSTALL = 'pip install "murmura[ops]"'


def add_parser(subparsers: Any) -> None:
    """``murmura dashboard``."""
    p = subparsers.add_parser(
        "dashboard", help="a live web page of a run directory (read-only)",
        description="Serve a read-only web page of the run in --run DIR: accuracy and loss "
        "over versions and time, updates per second, refusals and the aggregation tier, from "
        "its metrics.jsonl (followed while the run writes it) and summary.json. Other runs "
        "in DIR's parent open from the page. Loopback by default; another address needs "
        f"--token (or ${TOKEN_ENV}) and TLS. Needs the ops extra: {INSTALL}.")
    p.add_argument("--run", required=True, metavar="DIR",
                   help="the run directory to show (murmura run/server/simulate --out)")
    p.add_argument("--address", default=DEFAULT_ADDRESS, metavar="HOST:PORT",
                   help="where to serve the page (port 0: any free port, printed at start)")
    p.add_argument("--token", default=None,
                   help=f"require this token on every request (default: ${TOKEN_ENV}; needed "
                   "off loopback)")
    p.add_argument("--tls-cert", default="", metavar="PEM",
                   help="serve HTTPS with this certificate (needed off loopback)")
    p.add_argument("--tls-key", default="", metavar="PEM", help="the certificate's key")
    p.add_argument("--insecure", action="store_true",
                   help="off loopback, serve plain HTTP (the token still applies)")
    p.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    p.add_argument("-q", "--quiet", action="count", default=0,
                   help="no start-up line; only warnings")
    p.set_defaults(fn=cmd_dashboard)


def add_dashboard_flags(p: argparse.ArgumentParser, *, tls: bool) -> None:
    """``--dashboard ADDR``, ``--dashboard-token`` and ``--dashboard-insecure`` for a command
    that runs an aggregator (``tls``: it takes ``--tls-cert``/``--tls-key``, reused here)."""
    g = p.add_argument_group("dashboard (docs/operations.md; needs the ops extra)")
    g.add_argument("--dashboard", default=None, metavar="HOST:PORT",
                   help="also serve a live read-only web page of the run here (loopback "
                   "unless --dashboard-token is given; port 0: any free port)")
    g.add_argument("--dashboard-token", default=None, metavar="TOKEN",
                   help=f"require this token on every dashboard request (default: "
                   f"${TOKEN_ENV}; needed off loopback)")
    g.add_argument("--dashboard-insecure", action="store_true",
                   help="off loopback, serve the dashboard over plain HTTP"
                   + (" when --tls-cert is not given" if tls else ""))


def _require_dependencies() -> None:
    from murmura.server.dashboard import missing_dependency

    name = missing_dependency()
    if name is not None:
        raise UsageError(f"the dashboard needs {name}, which is not installed: {INSTALL}")


def _token(given: str | None) -> str:
    return given if given is not None else os.environ.get(TOKEN_ENV, "")


def _check_tls_files(cert: str, key: str) -> None:
    for path, what in ((cert, "--tls-cert"), (key, "--tls-key")):
        if path and not Path(path).is_file():
            raise UsageError(f"{what} {path[:80]}: no such file")


def plan_for(args: argparse.Namespace, *, tls_cert: str = "", tls_key: str = "") -> Any:
    """The dashboard's bind plan from a server or run command's flags, or None without
    ``--dashboard``; ``tls_cert``/``tls_key`` are the server's (reused off loopback)."""
    from murmura.server.dashboard import DashboardError, plan_bind

    address = getattr(args, "dashboard", None)
    if not address:
        return None
    try:
        return plan_bind(address, token=_token(getattr(args, "dashboard_token", None)),
                         tls_cert=tls_cert, tls_key=tls_key,
                         insecure=bool(getattr(args, "dashboard_insecure", False)))
    except DashboardError as exc:
        raise UsageError(str(exc)) from None


@check("server", "run", "peer")
def _check_dashboard_flags(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    if not getattr(args, "dashboard", None):
        if getattr(args, "dashboard_token", None) or getattr(args, "dashboard_insecure", False):
            raise UsageError("--dashboard-token and --dashboard-insecure need --dashboard "
                             "HOST:PORT")
        return
    table = toml.get("server") or {}
    if args.command == "server" and (getattr(args, "role", None) or table.get("role")) == "leaf":
        raise UsageError("--dashboard: a leaf forwards its updates upstream; serve the "
                         "dashboard from the top aggregator")
    if args.command == "run" and (getattr(args, "gossip", None)
                                  or (toml.get("run") or {}).get("gossip")):
        raise UsageError("--dashboard shows an aggregator and a gossip run has none; watch it "
                         "with `murmura dashboard --run OUT` in another terminal")
    cert = str(getattr(args, "tls_cert", None) or table.get("tls_cert", "") or "")
    key = str(getattr(args, "tls_key", None) or table.get("tls_key", "") or "")
    plan_for(args, tls_cert=cert, tls_key=key)
    _check_tls_files(cert, key)
    _require_dependencies()
    check_port_free(args.dashboard, "--dashboard")  # before a client is forked


@check("dashboard")
def _check_dashboard(args: argparse.Namespace, toml: dict[str, Any]) -> None:
    from murmura.server.dashboard import DashboardError, plan_bind

    run = Path(args.run)
    if not run.is_dir():
        raise UsageError(f"--run {args.run[:80]}: no such directory (a run's --out)")
    try:
        plan_bind(args.address, token=_token(args.token), tls_cert=args.tls_cert,
                  tls_key=args.tls_key, insecure=args.insecure, what="--address",
                  token_flag="--token", insecure_flag="--insecure")
    except DashboardError as exc:
        raise UsageError(str(exc)) from None
    _check_tls_files(args.tls_cert, args.tls_key)
    _require_dependencies()
    check_port_free(args.address, "--address")


def _start(server: Any, what: str) -> Any:
    try:
        return server.start()
    except OSError as exc:
        raise UsageError(f"{what}: cannot listen on {server.plan.host[:60]}:{server.plan.port} "
                         f"({exc.strerror or exc})") from None


def cmd_dashboard(args: argparse.Namespace) -> int:
    from murmura.server.dashboard import DashboardServer, RunDirFeed, plan_bind

    configure_logging(args, logging.WARNING)
    plan = plan_bind(args.address, token=_token(args.token), tls_cert=args.tls_cert,
                     tls_key=args.tls_key, insecure=args.insecure, what="--address",
                     token_flag="--token", insecure_flag="--insecure")
    run = Path(args.run).resolve()
    server = _start(DashboardServer(RunDirFeed(run), plan, runs_root=run.parent), "--address")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not args.quiet:
            print(f"murmura dashboard: {server.url} (run {run}; Ctrl-C to stop)", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
    return 0


class LiveDashboard:
    """A dashboard beside a running aggregator: the web thread, and the task posting the
    telemetry's snapshots from the aggregator's loop. Stop it before the loop stops."""

    def __init__(self, server: Any, poster: asyncio.Future[Any] | PeerPoster | None) -> None:
        self.server = server
        self.poster = poster

    @property
    def url(self) -> str:
        return str(self.server.url)

    def cancel_poster(self) -> None:
        """Stop posting (an aggregator's poster: on its loop; a peer's: from any thread)."""
        if self.poster is not None:
            self.poster.cancel()

    def stop(self) -> None:
        self.server.stop()


def start_live(plan: Any, core: Any, out: Path,
               call: Callable[[Callable[[], Any]], Any] | None = None) -> LiveDashboard:
    """A dashboard of ``core``'s run: a task on the event loop that owns the core posts its
    snapshots, and a new thread serves them. Call it on that loop, or pass ``call`` (a
    function that runs a function there and returns its result: ``ServerThread.call``).
    Raises UsageError when the address cannot be bound."""
    from murmura.server.dashboard import DashboardServer, LiveFeed, post_snapshots

    feed = LiveFeed(out)
    snapshot = core.telemetry.snapshot

    def begin() -> asyncio.Future[Any]:  # on the core's loop
        feed.post(snapshot())
        return asyncio.ensure_future(post_snapshots(feed, snapshot, every_s=POST_EVERY_S))

    poster = call(begin) if call is not None else begin()
    try:
        server = _start(DashboardServer(feed, plan, runs_root=Path(out).resolve().parent),
                        "--dashboard")
    except BaseException:
        if call is not None:
            call(poster.cancel)
        else:
            poster.cancel()
        raise
    return LiveDashboard(server, poster)


def announce(dashboard: LiveDashboard, *, stream: Any = None) -> None:
    """The one line naming the dashboard's URL (printed even with ``-q``, as the server's
    address is: with port 0 it is the only way to find the page)."""
    print(f"murmura dashboard on {dashboard.url}", file=stream or sys.stdout, flush=True)


class PeerPoster(threading.Thread):
    """Posts a peer's snapshots every ``every_s`` seconds from its own thread: a peer has no
    event loop that owns its state, and :func:`~murmura.gossip.prometheus.peer_snapshot`
    copies the view under the runtime's lock itself. A failing snapshot is skipped."""

    def __init__(self, feed: Any, snapshot: Callable[[], Any], every_s: float) -> None:
        super().__init__(name="dashboard-poster", daemon=True)
        self.feed, self.snapshot, self.every_s = feed, snapshot, every_s
        self._stop = threading.Event()

    def run(self) -> None:
        failures = 0
        while True:
            try:
                self.feed.post(self.snapshot())
            except Exception:
                failures += 1
                if failures == 1:
                    logging.getLogger(__name__).exception(
                        "dashboard: the peer's snapshot failed; the page shows the last one")
            if self._stop.wait(self.every_s):
                return

    def cancel(self) -> None:
        self._stop.set()


def start_peer_live(plan: Any, snapshot: Callable[[], Any], rows_dir: Path) -> LiveDashboard:
    """A dashboard beside ``murmura peer``: the peer's snapshots (its view of the other peers,
    rounds, models mixed) posted by a thread, and the rows of ``rows_dir/metrics.jsonl``
    (the caller appends one per round). Raises UsageError when the address cannot be bound."""
    from murmura.server.dashboard import DashboardServer, LiveFeed

    feed = LiveFeed(rows_dir)
    feed.post(snapshot())
    server = _start(DashboardServer(feed, plan, runs_root=None), "--dashboard")
    poster = PeerPoster(feed, snapshot, POST_EVERY_S)
    poster.start()
    return LiveDashboard(server, poster)
