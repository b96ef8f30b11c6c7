"""Client processes from the command line: ``murmura client`` (one client against an
aggregator), ``murmura launch`` (N per device, restarted on crashes), and the clients that
``murmura run`` starts on loopback (:class:`ClientLauncher`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmura.common import configure_logging
from murmura.config import build, read_toml

if TYPE_CHECKING:
    from murmura.run import RunConfig

log = logging.getLogger("murmura")

__all__ = ["ClientLauncher", "cmd_client", "cmd_launch", "run_client", "run_identity"]


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

    configure_logging(args, logging.INFO)
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
