"""Client processes from the command line: ``murmura client`` (one client against an
aggregator), ``murmura launch`` (N per device, restarted on crashes), and the clients that
``murmura run`` starts on loopback (:class:`ClientLauncher`)."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmura.common import configure_logging
from murmura.config import build, read_toml

if TYPE_CHECKING:
    from murmura.run import RunConfig

log = logging.getLogger("murmura")

__all__ = ["ERROR_PREFIX", "ClientLauncher", "FlowerApp", "TaskLines", "add_flower_arguments",
           "cmd_client", "cmd_launch", "error_line", "flower_given", "flower_server_settings",
           "run_client", "run_identity"]


@dataclass(frozen=True)
class FlowerApp:
    """A Flower app in place of ``--task``'s model (``--flower-app``, docs/flower.md): what
    ``murmura run`` hands its clients instead of a task config."""

    ref: str
    run_config: str | None = None


def add_flower_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--flower-app`` and ``--run-config``: a Flower app in place of ``--task``'s model
    (docs/flower.md); ``what`` starts the help line ("train with", "serve the model of")."""
    p.add_argument("--flower-app", default=None, metavar="APP",
                   help=f"{what} this Flower app instead of --task's model: a Message-API "
                   f"ClientApp, NumPyClient or client_fn as MODULE:ATTR (MODULE importable or "
                   f"FILE.py), or the app's directory; see docs/flower.md")
    p.add_argument("--run-config", default=None, metavar="'K=V ...'",
                   help="with --flower-app: override the app's run config (its pyproject's "
                   "[tool.flwr.app.config]), as flwr run --run-config does")


def flower_given(args: Any, toml: dict[str, Any]) -> set[str]:
    """The cohort settings the user set (``--cohort-fraction``/``--cohort-size``, or in the
    config file's ``[server]`` table): a Flower app's ``fraction-train`` does not replace
    them. Completes ``murmura.server.flower.given_keys``."""
    server = toml.get("server", {}) or {}
    policy = server.get("policy", {}) or {}
    return {k for k in ("cohort_fraction", "cohort_size")
            if getattr(args, k, None) is not None or k in server or k in policy}


def flower_server_settings(server: Any, ref: str, run_config: str | None,
                           given: set[str]) -> Any:
    """``server`` with what the Flower app's ServerApp settings map to (``fraction-train``
    -> ``cohort_fraction`` in sync mode), logging the one-line notice of what is applied and
    what is ignored (client/flower_app.py ``server_app_settings``). Reads the app's
    pyproject only: the app itself is loaded afterwards, by ``flower_core``."""
    from murmura.client.flower_app import server_app_settings
    from murmura.client.flower_load import app_run_config

    mapped = server_app_settings(app_run_config(ref, run_config), mode=server.mode,
                                 given=given)
    if mapped.notice:
        log.log(logging.WARNING if "ignored" in mapped.notice else logging.INFO, "%s",
                mapped.notice)
    return server.replace(**mapped.settings) if mapped.settings else server


#: How a client's last line starts when it fails (`murmura client` prints it, and so does a
#: forked client of `murmura run` into its log, where the run finds it).
ERROR_PREFIX = "murmura client: "


# -- murmura client ---------------------------------------------------------------------------

class TaskLines:
    """``murmura client``'s feedback: a line per finished task (when ``show``), and the
    versions it trained on for the closing line. The server sends a client no global
    accuracy, so the client reports what it knows."""

    def __init__(self, show: bool = True) -> None:
        self.show = show
        self.tasks = 0
        self.first: int | None = None
        self.last: int | None = None

    def __call__(self, report: Any) -> None:
        self.tasks += 1
        self.first = report.version if self.first is None else self.first
        self.last = report.version
        if not self.show:
            return
        loss = report.metrics.get("train_loss")
        if report.pushed:
            outcome = "pushed (a duplicate: counted once)" if report.duplicate else \
                f"pushed (staleness {report.staleness})"
        else:
            outcome = f"refused ({report.refused})"
        print(f"task {self.tasks}: version {report.version}, {report.examples} examples"
              + (f", loss {loss:.4f}" if isinstance(loss, float) else "")
              + f" -> {outcome}", flush=True)

    def versions(self) -> str:
        """``; trained on versions A..B`` (or ``version A``), empty before any task."""
        if self.first is None:
            return ""
        if self.first == self.last:
            return f"; trained on version {self.first}"
        return f"; trained on versions {self.first}..{self.last}"


def run_client(cfg: Any, task_cfg: Any, *, identity: Any = None, report: bool = True,
               tasks: bool = False) -> Any:
    """Join ``cfg.server`` and train the bundled task's share ``cfg.client_index``, under
    ``identity`` if given (else ``cfg``'s key, a fresh one, or its legacy client id); with
    ``tasks``, print a line per finished task. A :class:`FlowerApp` in place of the task
    trains that Flower app (``murmura run --flower-app``)."""
    if isinstance(task_cfg, FlowerApp):
        from murmura.client.flower_load import run_flower_client

        return run_flower_client(cfg, task_cfg.ref, identity=identity,
                                 run_config_overrides=task_cfg.run_config)
    import torch

    from murmura.client import GrpcTransport, RemoteError
    from murmura.client.build import build_client
    from murmura.client.status import finish_status
    from murmura.protocols.tls import channel_credentials

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if identity is None:
        identity = cfg.node_key()  # before anything is loaded: a bad key file fails now
    tls = cfg.tls()
    if tls is not None:
        channel_credentials(tls)  # the same: missing or mismatched files fail now
    # a first contact waits at most a few seconds (or the give-up time) before it says so
    connect_s = min(3.0, max(min(cfg.give_up_after_s, cfg.give_up_unreached_s), 0.5))
    transport = GrpcTransport(cfg.server, tls=tls, insecure=cfg.insecure,
                              connect_timeout_s=connect_s)
    try:
        # one try before loading data: a wrong address is reported (a warning naming it)
        # within seconds, a TLS mismatch ends the client at once; the runtime then retries
        # until --give-up-unreached-s (never answered) or --give-up-after-s
        first_try = time.monotonic()  # the runtime's clock: its never-answered limit counts
        try:                          # from this try, not from after the data is loaded
            transport.connect()
        except RemoteError as exc:
            if not exc.retryable:
                raise
        runtime = build_client(cfg, task_cfg, transport, identity=identity)
        runtime.first_try = first_try
        log.info("client id %s", runtime.client_id)
        lines = TaskLines(show=tasks)
        runtime.on_task = lines
        stats = runtime.run(max_tasks=cfg.max_tasks)
        if cfg.status_file:  # murmura launch's table: done, at the run's last version
            finish_status(cfg.status_file, stats.version)
        if report:  # (murmura run's in-process clients would print one line each)
            print(f"client {runtime.client_id}: {stats.pushed} updates pushed, "
                  f"{stats.refused} refused, {stats.retries} retries{lines.versions()}",
                  flush=True)
        return stats
    finally:
        transport.close()


def cmd_client(args: argparse.Namespace) -> int:
    from murmura.client import ClientConfig, RemoteError
    from murmura.tasks import TaskConfig

    configure_logging(args, logging.INFO)
    toml = read_toml(args.config)
    cfg = build(ClientConfig, toml.get("client"), args, section="client")
    task = build(TaskConfig, toml.get("task"), args, section="task")
    try:
        identity = None
        if args.run_key_seed is not None:  # a client process of `murmura run` (not on Linux)
            identity, _ = run_identity(args.run_key_seed, cfg.client_index)
        if args.flower_app:  # a Flower client as the trainer (docs/flower.md)
            from murmura.client.flower_load import run_flower_client

            stats = run_flower_client(cfg, args.flower_app, identity=identity,
                                      run_config_overrides=args.run_config)
            print(f"client: {stats.pushed} updates pushed, {stats.refused} refused",
                  flush=True)
        else:
            run_client(cfg, task, identity=identity, tasks=args.quiet == 0)
    except RemoteError as exc:
        from murmura.client.transport import TlsMismatch

        plain = exc.status == "UNAVAILABLE" or isinstance(exc, TlsMismatch)
        print(f"murmura client: {exc.message if plain else exc}", file=sys.stderr)
        return 2
    return 0


# -- murmura run's clients --------------------------------------------------------------------

class ClientLauncher:
    """Starts ``murmura run``'s client processes.

    On Linux the processes are forked from this one once the modules they need are imported:
    starting ten fresh interpreters that each import torch costs tens of seconds on a small
    machine. Forking happens in ``__init__``, before this process runs any torch op or creates
    any gRPC channel (neither survives a fork); the children then wait for the server's
    address. Elsewhere each client is a fresh ``python -m murmura client`` process.
    """

    def __init__(self, run: RunConfig, task: Any, out: Path, device: str | None,
                 key_seed: int | None = None) -> None:
        self.run, self.task, self.device = run, task, device
        self.key_seed = key_seed
        self.logs = out / "clients"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.clients: list[Any] = []
        #: Why each in-process client (thread) that failed did: one line, by client index.
        self.errors: dict[int, str] = {}
        self._queue: Any = None
        if run.in_process:
            return
        import multiprocessing as mp

        if sys.platform.startswith("linux"):
            import murmura.client.build  # noqa: F401  (shared with the children, copy-on-write)
            import murmura.tasks.registry  # noqa: F401

            ctx = mp.get_context("fork")
            self._queue = ctx.SimpleQueue()
            sys.stdout.flush()
            sys.stderr.flush()
            for i in range(run.clients):
                p = ctx.Process(target=_forked_client, name=f"client-{i:03d}",
                                args=(self._queue, task, i, run,
                                      str(self.logs / f"client-{i:03d}.log"), device,
                                      key_seed))
                p.start()
                self.clients.append(p)

    def start(self, address: str) -> list[Any]:
        if self.run.in_process:
            for i in range(self.run.clients):
                t = threading.Thread(target=_client_thread, daemon=True, name=f"client-{i}",
                                     args=(self.task, address, i, self.run, self.key_seed,
                                           self.errors))
                t.start()
                self.clients.append(t)
        elif self._queue is not None:
            for _ in self.clients:
                self._queue.put(address)
        else:
            for i in range(self.run.clients):
                self.clients.append(self._spawn(address, i))
        return self.clients

    def log_path(self, index: int) -> Path | None:
        """Client ``index``'s log file (None for an in-process client: it logs here)."""
        return None if self.run.in_process else self.logs / f"client-{index:03d}.log"

    def failure(self, index: int) -> str | None:
        """Why client ``index`` failed, in one line: its recorded error, or the last
        ``murmura client:`` line of its log; None if it said nothing."""
        if index in self.errors:
            return self.errors[index]
        path = self.log_path(index)
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines() \
                if path is not None else []
        except OSError:
            return None
        said = [line for line in lines if line.startswith(ERROR_PREFIX)]
        return said[-1].removeprefix(ERROR_PREFIX) if said else None

    def why_failed(self, failed: list[int]) -> str:
        """One line on ``failed`` clients: the first cause found, which client said it, and
        where its log is (a run whose clients all fail alike says it once)."""
        causes = {i: self.failure(i) for i in failed}
        first = next((i for i in failed if causes[i]), failed[0])
        cause = causes[first] or "it exited without saying why"
        kind = "client threads" if self.run.in_process else "clients"
        text = f"{len(failed)} of {self.run.clients} {kind} failed; client {first}: {cause}"
        where = self.log_path(first)
        if where is not None:
            text += f" (its log: {where})"
        others = sum(causes[i] != causes[first] for i in failed)
        if others:
            text += (f"; {others} failed otherwise" + (f": see {self.logs}/"
                                                        if where is not None else ""))
        return text

    def _spawn(self, address: str, i: int) -> subprocess.Popen[bytes]:
        task = self.task
        who = (["--client-id", f"client-{i:03d}"] if self.key_seed is None
               else ["--run-key-seed", str(self.key_seed)])
        cmd = [sys.executable, "-m", "murmura", "client", "--server", address, *who,
               "--client-index", str(i),
               "--num-clients", str(self.run.clients), "--threads", str(self.run.client_threads)]
        if isinstance(task, FlowerApp):
            cmd += ["--flower-app", task.ref] + (["--run-config", task.run_config]
                                                 if task.run_config else [])
        else:
            cmd += ["--task", task.task, "--model", task.model, "--partition", task.partition,
                    "--alpha", str(task.alpha), "--data-seed", str(task.data_seed)]
        if not isinstance(task, FlowerApp) and task.app:
            cmd += ["--app", task.app]
        if self.device:
            cmd += ["--device", self.device]
        with open(self.logs / f"client-{i:03d}.log", "wb") as logf:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,  # Ctrl-C: the parent stops them
                                    start_new_session=sys.platform != "win32")


def run_identity(key_seed: int | None, index: int) -> tuple[Any, str]:
    """``murmura run``'s client ``index``: a key derived from the run seed, or (identities
    off) no key and the legacy id. Derived keys make reruns identical; they protect nothing
    against someone on this machine who knows the seed, which is fine on loopback only."""
    from murmura.protocols.identity import NodeKey

    if key_seed is None:
        return None, f"client-{index:03d}"
    return NodeKey.from_seed(f"murmura-run/{key_seed}/{index}"), ""


def _forked_client(queue: Any, task: Any, index: int, run: RunConfig, log_path: str,
                   device: str | None, key_seed: int | None = None) -> None:
    import os

    from murmura.client import ClientConfig

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent tells clients to stop
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    address = queue.get()
    identity, legacy_id = run_identity(key_seed, index)
    cfg = ClientConfig(server=address, client_id=legacy_id, client_index=index,
                       num_clients=run.clients, threads=run.client_threads,
                       device=device or "auto")
    try:
        run_client(cfg, task, identity=identity)
    except Exception as exc:  # the traceback, then the line `murmura run` reports
        log.error("client %d failed", index, exc_info=True)
        print(f"{ERROR_PREFIX}{error_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(2)


def _client_thread(task_cfg: Any, address: str, index: int, run: RunConfig,
                   key_seed: int | None = None, errors: dict[int, str] | None = None) -> None:
    from murmura.client import ClientConfig

    # torch's thread count is per calling thread, so each client thread sets its own
    identity, legacy_id = run_identity(key_seed, index)
    cfg = ClientConfig(server=address, client_id=legacy_id, client_index=index,
                       num_clients=run.clients, device="cpu", threads=run.client_threads)
    try:
        run_client(cfg, task_cfg, identity=identity, report=False)
    except Exception as exc:  # `murmura run` reports it in one line, not a thread traceback
        if errors is None:
            raise
        log.debug("client %d failed", index, exc_info=True)
        errors[index] = error_line(exc)


def error_line(exc: BaseException) -> str:
    """A client's failure in one line: the message of an error that names its cause (a bad
    app or option: ValueError; a refusal: RemoteError), else the exception's type too."""
    from murmura.client import RemoteError

    text = " ".join(str(exc).split())
    if isinstance(exc, RemoteError) and exc.status == "UNAVAILABLE":
        text = " ".join(exc.message.split())
    elif not isinstance(exc, ValueError | RemoteError):
        text = f"{type(exc).__name__}: {text}"
    return text[:500]


# -- murmura launch ---------------------------------------------------------------------------

def cmd_launch(args: argparse.Namespace) -> int:
    from murmura.edge.launch import Launcher, detect_devices

    configure_logging(args, logging.WARNING)
    if ":" not in args.server:
        raise ValueError(f"server must be HOST:PORT, got {args.server[:40]!r}")
    devices = detect_devices(args.devices)
    passthrough: list[str] = []
    if args.config:
        passthrough += ["--config", args.config]
    if args.token:
        passthrough += ["--token", args.token]
    for opt in args.client_option or []:
        passthrough += opt.split(None, 1) if opt.startswith("--") else [opt]
    launcher = Launcher(args.server, devices, clients_per_device=args.clients_per_device,
                        memory_fraction=args.memory_fraction,
                        client_index_start=args.client_index_start,
                        num_clients=args.num_clients, client_args=passthrough,
                        work_dir=args.work_dir)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: launcher.stop())
    print(f"murmura launch: {len(launcher.slots)} clients on {', '.join(devices)} -> "
          f"{args.server}", flush=True)
    return launcher.run(out=sys.stdout, table_every_s=args.table_every_s)
