"""The ``murmura`` command: run, server, client, peer, simulate, keys, certs (and
``python -m murmura``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from murmura import __version__
from murmura.config import add_arguments, build, read_toml
from murmura.progress import Progress
from murmura.validate import UsageError

log = logging.getLogger("murmura")


@dataclass(frozen=True)
class RunConfig:
    """``murmura run``: an aggregator and N client processes on loopback."""

    clients: int = 10
    out: str = "runs/latest"
    client_threads: int = 1
    timeout_s: float = 900.0
    in_process: bool = False   # clients as threads of this process instead of processes
    gossip: bool = False       # N peer processes and no server ([gossip] table, docs/gossip.md)

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


def _task_and_server(args: argparse.Namespace, toml: dict[str, Any], **overrides: Any):  # noqa: ANN202
    from murmura.server import ServerConfig
    from murmura.tasks import TaskConfig

    task = build(TaskConfig, toml.get("task"), args, section="task")
    server = build(ServerConfig, toml.get("server"), args, section="server", overrides=overrides)
    if server.train.seed != server.seed:  # one seed for the run, shared with clients
        server = dataclasses.replace(server, train=dataclasses.replace(server.train,
                                                                       seed=server.seed))
    return task, server


def _configure_logging(args: argparse.Namespace, default: int) -> None:
    level = default - 10 * args.verbose + 10 * args.quiet
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- murmura run ------------------------------------------------------------------------------

def _check_mode_flags(args: argparse.Namespace, *, gossip: bool) -> None:
    """Refuse flags that the chosen mode would silently ignore: ``murmura run --rounds 5``
    without ``--gossip`` used to run the server's 30 versions."""
    wrong = [d for d in (args.server_only if gossip else args.gossip_only)
             if getattr(args, d, None) is not None]
    if not wrong:
        return
    flags = ", ".join("--" + d.replace("_", "-").removesuffix("s") if d.endswith("_options")
                      else "--" + d.replace("_", "-") for d in wrong)
    if gossip:
        raise UsageError(f"{flags}: aggregator option{'s' * (len(wrong) > 1)}, and a gossip run "
                         f"has no aggregator; its length is --rounds and its rule --rule")
    raise UsageError(f"{flags}: gossip option{'s' * (len(wrong) > 1)}, used only with --gossip; "
                     f"a server run's length is --max-versions (default 30)")


def cmd_run(args: argparse.Namespace) -> int:
    from murmura.server import ServerThread, build_core

    _configure_logging(args, logging.WARNING)
    toml = read_toml(args.config)
    run = build(RunConfig, toml.get("run"), args, section="run")
    _check_mode_flags(args, gossip=run.gossip)
    if run.gossip:
        from murmura.peers import cmd_run_gossip

        return cmd_run_gossip(args, run, toml)
    given_min = args.min_clients is not None or "min_clients" in toml.get("server", {})
    task, server = _task_and_server(args, toml, address="127.0.0.1:0")
    if not given_min:  # wait for every client before the first round: a deterministic cohort
        server = dataclasses.replace(server, min_clients=run.clients)
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()  # a new run starts a new metrics file
    quiet = args.quiet > 0
    if not quiet:
        print(f"murmura run: {run.clients} clients, mode={server.mode}, "
              f"task={task.app or task.task}, codec={server.train.codec}, out={out}",
              file=sys.stderr)
    t0 = time.monotonic()
    # Fork client processes first, before this process runs any torch op or gRPC call.
    # Clients prove keys derived from the run seed (the same ids, cohorts and seeds on every
    # rerun); with identities off they join under the legacy ids client-000, ... as the
    # simulator's clients do.
    key_seed = server.seed if server.require_identity else None
    launcher = ClientLauncher(run, task, out, args.device, key_seed)
    core = build_core(server, task, out_dir=out, extra_config={"run": dataclasses.asdict(run)})
    progress = Progress(server.max_versions, quiet=quiet)
    interrupted = threading.Event()
    with ServerThread(core) as srv, _on_sigint(interrupted, quiet):
        if not quiet:
            print(f"aggregator listening on {srv.address}", file=sys.stderr)
        clients = launcher.start(srv.address)
        try:
            finished = _watch(srv, core, progress, clients, run.timeout_s, interrupted)
        finally:
            progress.close()
            if interrupted.is_set():  # tell clients to stop; what ran is summarised below
                srv.call(core.stop)
            failed = _stop_clients(clients, 5.0 if interrupted.is_set() else 30.0)
        metrics = srv.call(lambda: dict(core.last_metrics))
    assert core.recorder is not None  # build_core with an out_dir records the run
    summary = core.recorder.finish({"wall_s": time.monotonic() - t0, "clients_failed": failed,
                                    "interrupted": interrupted.is_set()})
    if interrupted.is_set():
        print(f"interrupted at version {metrics.get('version', 0)}", file=sys.stderr)
    elif not finished:
        why = "timeout" if time.monotonic() - t0 >= run.timeout_s else "clients exited"
        print(f"run did not finish ({why}) at version {metrics.get('version', 0)}",
              file=sys.stderr)
    acc = summary.get("final_accuracy")
    ppl = metrics.get("perplexity")  # a language model's (the lm task)
    print(f"final test accuracy {acc:.4f}"
          + (f", perplexity {ppl:.2f}" if isinstance(ppl, float) else "")
          + f" after {summary['versions']} versions "
          f"({summary['updates']} updates, {summary['bytes_up'] / 1e6:.2f} MB up) "
          f"in {summary['wall_s']:.1f} s" if acc is not None else "no version was published")
    written = [f"{out}/{name}" for name in ("metrics.jsonl", "summary.json", "accuracy.png")
               if (out / name).exists()]
    print(f"results: {', '.join(written)}")
    if interrupted.is_set():
        return 130
    return 0 if finished and not failed else 1


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
        self._queue: Any = None
        if run.in_process:
            return
        import multiprocessing as mp

        if sys.platform.startswith("linux"):
            import murmura.client  # noqa: F401  (shared with the children, copy-on-write)
            import murmura.tasks  # noqa: F401

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
                                     args=(self.task, address, i, self.run, self.key_seed))
                t.start()
                self.clients.append(t)
        elif self._queue is not None:
            for _ in self.clients:
                self._queue.put(address)
        else:
            for i in range(self.run.clients):
                self.clients.append(self._spawn(address, i))
        return self.clients

    def _spawn(self, address: str, i: int) -> subprocess.Popen[bytes]:
        task = self.task
        who = (["--client-id", f"client-{i:03d}"] if self.key_seed is None
               else ["--run-key-seed", str(self.key_seed)])
        cmd = [sys.executable, "-m", "murmura", "client", "--server", address, *who,
               "--client-index", str(i),
               "--num-clients", str(self.run.clients), "--threads", str(self.run.client_threads),
               "--task", task.task, "--model", task.model, "--partition", task.partition,
               "--alpha", str(task.alpha), "--data-seed", str(task.data_seed)]
        if task.app:
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
    run_client(cfg, task, identity=identity)


def _client_thread(task_cfg: Any, address: str, index: int, run: RunConfig,
                   key_seed: int | None = None) -> None:
    from murmura.client import ClientConfig

    # torch's thread count is per calling thread, so each client thread sets its own
    identity, legacy_id = run_identity(key_seed, index)
    cfg = ClientConfig(server=address, client_id=legacy_id, client_index=index,
                       num_clients=run.clients, device="cpu", threads=run.client_threads)
    run_client(cfg, task_cfg, identity=identity, report=False)


def _alive(c: Any) -> bool:
    if isinstance(c, subprocess.Popen):
        return c.poll() is None
    return bool(c.is_alive())


def _watch(srv: Any, core: Any, progress: Progress, clients: list[Any], timeout: float,
           interrupted: threading.Event | None = None) -> bool:
    """Follow the run until it is done, times out, its clients are gone or Ctrl-C; until the
    first version, show start-up progress (clients running, joined)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if srv.wait_done(timeout=0.25):
            progress.update(srv.call(lambda: dict(core.last_metrics)))
            return True
        if interrupted is not None and interrupted.is_set():
            return False
        row = srv.call(lambda: dict(core.last_metrics))
        if int(row.get("version", 0)) == 0:
            joined = srv.call(lambda: len(core.sessions))
            running = sum(_alive(c) for c in clients)
            kind = "threads" if clients and isinstance(clients[0], threading.Thread) \
                else "processes"
            progress.starting(f"starting: {running}/{len(clients)} client {kind} running, "
                              f"{joined}/{len(clients)} joined",
                              key=(running, joined), elapsed=time.monotonic() - t0)
        else:
            progress.update(row)
        if not any(_alive(c) for c in clients):
            return bool(srv.call(lambda: core.done))
    return False


@contextlib.contextmanager
def _on_sigint(event: threading.Event, quiet: bool = False) -> Iterator[None]:
    """While inside: the first Ctrl-C sets ``event`` (the run stops and writes its summary and
    plot); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        event.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not quiet:
            print("\ninterrupted: stopping the clients and writing the summary (Ctrl-C again "
                  "to quit at once)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_clients(clients: list[Any], grace_s: float = 30.0) -> int:
    """Wait for clients to leave after the server's STOP; end stragglers. Returns failures."""
    deadline = time.monotonic() + grace_s
    failed = 0
    for c in clients:
        if isinstance(c, threading.Thread):
            c.join(max(deadline - time.monotonic(), 0.1))
            continue
        if isinstance(c, subprocess.Popen):
            try:
                c.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.terminate()
                c.wait(10)
            code = c.returncode
        else:  # multiprocessing.Process
            c.join(max(deadline - time.monotonic(), 0.1))
            if c.is_alive():
                c.terminate()
                c.join(10)
            code = c.exitcode
        if code not in (0, -signal.SIGTERM):
            failed += 1
            log.error("a client process exited with code %s (see its log)", code)
    return failed


# -- murmura server ---------------------------------------------------------------------------

def cmd_server(args: argparse.Namespace) -> int:
    _configure_logging(args, logging.INFO)
    toml = read_toml(args.config)
    task, server = _task_and_server(args, toml)
    return asyncio.run(_serve(server, task, args))


async def _serve(server_cfg: Any, task: Any, args: argparse.Namespace) -> int:
    from murmura.server import AggregatorServer, build_core

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the address is announced
        loop.add_signal_handler(sig, stop.set)
    if server_cfg.tls_cert:  # check the certificate files before loading anything
        from murmura.protocols.tls import server_credentials

        server_credentials(server_cfg.tls_cert, server_cfg.tls_key, server_cfg.client_ca or None)
    if server_cfg.role == "leaf":
        return await _serve_leaf(server_cfg, task, args, stop)
    out = Path(args.out)
    resume = args.resume
    if resume == "auto":
        candidate = out / "checkpoint.npz"
        resume = str(candidate) if candidate.exists() else None
        if args.durable and (out / "state.db").exists():
            resume = None  # the durable state is the fuller record; it is used by itself
    # Durable (the default): OUT/state.db keeps what a restart needs, and a server started on
    # an OUT that holds state resumes from it (it logs "resumed from the durable state").
    if args.flower_app:  # the model a Flower client starts from (docs/flower.md)
        from murmura.server.flower import flower_core

        core = flower_core(server_cfg, args.flower_app, out_dir=out, resume=resume,
                           durable=args.durable)
    else:
        core = build_core(server_cfg, task, out_dir=out, resume=resume, durable=args.durable)
    srv = AggregatorServer(core)
    try:
        await srv.start()
    except (OSError, RuntimeError) as exc:  # taken between the check and the bind
        if "bind" not in str(exc).lower():
            raise
        raise ValueError(f"--address: cannot listen on {server_cfg.address[:60]} (port "
                         f"already in use?)") from None
    print(f"murmura server listening on {srv.address}", flush=True)
    done = asyncio.ensure_future(srv.wait_done())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if done.done() and not stop.is_set():
        log.info("reached %d versions; telling clients to stop", core.version)
        try:  # keep answering STOP for a moment so connected clients learn the run is over
            await asyncio.wait_for(stop.wait(), args.linger_s)
        except asyncio.TimeoutError:
            pass
    else:
        log.info("signal received; shutting down")
        core.stop()
    done.cancel()
    stopped.cancel()
    await srv.stop(grace=1.0)
    assert core.recorder is not None  # build_core with an out_dir records the run
    summary = core.recorder.finish()
    print(f"stopped at version {summary['versions']}; results in {out}", flush=True)
    return 0


async def _serve_leaf(server_cfg: Any, task: Any, args: argparse.Namespace,
                      stop: asyncio.Event) -> int:
    from murmura.server.leaf import Leaf

    leaf = Leaf(server_cfg, task, out_dir=Path(args.out))
    await leaf.start()
    print(f"murmura leaf listening on {leaf.address} (upstream {server_cfg.upstream})",
          flush=True)
    done = asyncio.ensure_future(leaf.wait_done())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if done.done() and not stop.is_set():
        log.info("the parent ended the run; telling clients to stop")
        try:
            await asyncio.wait_for(stop.wait(), args.linger_s)
        except asyncio.TimeoutError:
            pass
    done.cancel()
    stopped.cancel()
    await leaf.stop(grace=1.0)
    if leaf.link_error is not None:
        print(f"murmura server: the upstream link failed: {leaf.link_error}", file=sys.stderr)
        return 1
    print(f"leaf stopped; results in {args.out}", flush=True)
    return 0


# -- murmura client ---------------------------------------------------------------------------

def run_client(cfg: Any, task_cfg: Any, *, identity: Any = None, report: bool = True) -> Any:
    """Join ``cfg.server`` and train the bundled task's share ``cfg.client_index``, under
    ``identity`` if given (else ``cfg``'s key, a fresh one, or its legacy client id)."""
    import torch

    from murmura.client import GrpcTransport, RemoteError
    from murmura.client.build import build_client
    from murmura.protocols.tls import channel_credentials

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if identity is None:
        identity = cfg.node_key()  # before anything is loaded: a bad key file fails now
    tls = cfg.tls()
    if tls is not None:
        channel_credentials(tls)  # the same: missing or mismatched files fail now
    # a first contact waits at most a few seconds (or the give-up time) before it says so
    connect_s = min(3.0, max(cfg.give_up_after_s, 0.5))
    transport = GrpcTransport(cfg.server, tls=tls, insecure=cfg.insecure,
                              connect_timeout_s=connect_s)
    try:
        # one try before loading data: a wrong address is reported (a warning naming it)
        # within seconds; the runtime then retries until --give-up-after-s
        with contextlib.suppress(RemoteError):
            transport.connect()
        runtime = build_client(cfg, task_cfg, transport, identity=identity)
        log.info("client id %s", runtime.client_id)
        stats = runtime.run(max_tasks=cfg.max_tasks)
        if report:  # (murmura run's in-process clients would print one line each)
            print(f"client {runtime.client_id}: {stats.pushed} updates pushed, "
                  f"{stats.refused} refused, {stats.retries} retries", flush=True)
        return stats
    finally:
        transport.close()


def cmd_client(args: argparse.Namespace) -> int:
    from murmura.client import ClientConfig, RemoteError
    from murmura.tasks import TaskConfig

    _configure_logging(args, logging.INFO)
    toml = read_toml(args.config)
    cfg = build(ClientConfig, toml.get("client"), args, section="client")
    task = build(TaskConfig, toml.get("task"), args, section="task")
    try:
        identity = None
        if args.run_key_seed is not None:  # a client process of `murmura run` (not on Linux)
            identity, _ = run_identity(args.run_key_seed, cfg.client_index)
        if args.flower_app:  # a Flower client as the trainer (docs/flower.md)
            from murmura.client.flower import run_flower_client

            stats = run_flower_client(cfg, args.flower_app, identity=identity)
            print(f"client: {stats.pushed} updates pushed, {stats.refused} refused",
                  flush=True)
        else:
            run_client(cfg, task, identity=identity)
    except RemoteError as exc:
        print(f"murmura client: {exc.message if exc.status == 'UNAVAILABLE' else exc}",
              file=sys.stderr)
        return 2
    return 0


# -- murmura new ------------------------------------------------------------------------------

def cmd_new(args: argparse.Namespace) -> int:
    from murmura.new import scaffold

    path = scaffold(args.name, args.dir, force=args.force)
    print(f"wrote {path}; run it with: murmura run --app {path} --in-process")
    return 0


# -- murmura keys / certs --------------------------------------------------------------------

def cmd_keys(args: argparse.Namespace) -> int:
    from murmura.protocols.identity import NodeKey

    key = NodeKey.generate()
    pub = key.save(args.out)
    print(f"wrote {args.out} (private, mode 0600) and {pub}")
    print(f"client id  {key.client_id}")
    print(f"public key {key.public_hex}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from murmura.protocols import tls

    if args.certs_command == "init":
        cert, key = tls.make_ca(args.out)
        print(f"wrote {cert} (give it to clients: --tls-ca; to the server: --client-ca) "
              f"and {key} (keep it secret)")
    elif args.certs_command == "server":
        hosts = [h.strip() for h in args.host.split(",") if h.strip()]
        cert, key = tls.make_server_cert(args.ca, args.out, hosts)
        print(f"wrote {cert} and {key} for {', '.join(hosts)} "
              f"(murmura server --tls-cert {cert} --tls-key {key})")
    else:
        cert, key = tls.make_client_cert(args.ca, args.out, args.name)
        print(f"wrote {cert} and {key} (murmura client --tls-cert {cert} --tls-key {key})")
    return 0


# -- murmura launch ---------------------------------------------------------------------------

def cmd_launch(args: argparse.Namespace) -> int:
    from murmura.edge.launch import Launcher, detect_devices

    _configure_logging(args, logging.WARNING)
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


# -- parser -----------------------------------------------------------------------------------

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

CONFIG_HELP = ("TOML file with [task], [server], [client], [run], [simulation], [gossip] "
               "and [peer] tables, keys as the flags without dashes; flags override it; an "
               "unknown table or key is an error")
VERBOSE_HELP = "more log output (repeat for more: -vv)"
QUIET_HELP = "less output: no start-up or progress lines, only warnings and the result"

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

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
        p.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
        p.add_argument("-q", "--quiet", action="count", default=0, help=QUIET_HELP)

    p = sub.add_parser("run", help="aggregator + N clients on loopback, end to end",
                       description="Start an aggregator and N client processes on loopback, "
                       "train the task, and write metrics, a summary and plots to --out.")
    common(p)
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
    p.set_defaults(fn=cmd_run, server_only=sorted(server_only), gossip_only=sorted(gossip_only))

    p = sub.add_parser("server", help="run the aggregator service",
                       description="Serve the aggregator on --address until --max-versions "
                       "global versions exist or SIGINT/SIGTERM.")
    common(p)
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
    p.add_argument("--flower-app", default=None, metavar="MODULE:ATTR",
                   help="serve the model of this Flower NumPyClient/client_fn/ClientApp "
                   "(MODULE importable or FILE.py) instead of --task's model; see "
                   "docs/flower.md")
    p.set_defaults(fn=cmd_server)

    p = sub.add_parser("client", help="run one client against an aggregator",
                       description="Join --server, train on this client's share of the task's "
                       "data, push updates until the server says stop.")
    common(p)
    add_arguments(p, ClientConfig, title="client")
    add_arguments(p, TaskConfig, title="task")
    p.add_argument("--run-key-seed", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--flower-app", default=None, metavar="MODULE:ATTR",
                   help="train with this Flower NumPyClient/client_fn/ClientApp (MODULE "
                   "importable or FILE.py) instead of --task's model; see docs/flower.md")
    p.set_defaults(fn=cmd_client)

    p = sub.add_parser("peer", help="run one gossip peer (no server)",
                       description="Serve the Peer service on --listen, join through any "
                       "--bootstrap peer, and train with the peers it finds: each round it "
                       "trains on its data share, sends its model to a few peers and mixes "
                       "what it receives (docs/gossip.md).")
    common(p)
    add_arguments(p, PeerConfig, title="peer")
    add_arguments(p, GossipConfig, title="gossip")
    add_arguments(p, TaskConfig, title="task")
    p.set_defaults(fn=cmd_peer)

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
    common(p)
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


def main(argv: list[str] | None = None) -> int:
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
