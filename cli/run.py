"""``murmura run``: an aggregator in this process and N clients on loopback, followed until the
run is done, times out, loses its clients or is interrupted (Ctrl-C); then the summary.

The clients are started by :class:`~murmura.clients.ClientLauncher`; ``murmura run --gossip``
is :func:`murmura.peers.cmd_run_gossip`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from murmura.clients import ClientLauncher, FlowerApp, flower_given, flower_server_settings
from murmura.common import configure_logging, task_and_server
from murmura.config import build, read_toml
from murmura.dashboard import announce, plan_for, start_live
from murmura.progress import Progress, result_line
from murmura.runs import LiveRun
from murmura.validate import UsageError

log = logging.getLogger("murmura")

__all__ = ["RunConfig", "cmd_run"]


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

    configure_logging(args, logging.WARNING)
    toml = read_toml(args.config)
    run = build(RunConfig, toml.get("run"), args, section="run")
    _check_mode_flags(args, gossip=run.gossip)
    flower = FlowerApp(args.flower_app, args.run_config) \
        if getattr(args, "flower_app", None) else None  # a Flower app's run (docs/flower.md)
    if run.gossip and flower is not None:
        raise UsageError("--flower-app runs with an aggregator; it does not take --gossip")
    if run.gossip:
        from murmura.peers import cmd_run_gossip

        return cmd_run_gossip(args, run, toml)
    given_min = args.min_clients is not None or "min_clients" in toml.get("server", {})
    task, server = task_and_server(args, toml, address="127.0.0.1:0")
    if not given_min:  # wait for every client before the first round: a deterministic cohort
        server = server.replace(min_clients=run.clients)
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()  # a new run starts a new metrics file
    quiet = args.quiet > 0
    if not quiet:
        print(f"murmura run: {run.clients} clients, mode={server.mode}, "
              f"task={flower.ref if flower else task.app or task.task}, "
              f"codec={server.train.codec}, out={out}",
              file=sys.stderr)
    t0 = time.monotonic()
    # Fork client processes first, before this process runs any torch op or gRPC call.
    # Clients prove keys derived from the run seed (the same ids, cohorts and seeds on every
    # rerun); with identities off they join under the legacy ids client-000, ... as the
    # simulator's clients do.
    key_seed = server.seed if server.security.require_identity else None
    launcher = ClientLauncher(run, flower or task, out, args.device, key_seed)
    live = LiveRun(out, "run", server.metrics_address, quiet=quiet)  # binds the metrics port
    if flower is not None:  # after the fork: loading the app may run torch ops
        from murmura.server.flower import flower_core, given_keys

        server = flower_server_settings(server, flower.ref, flower.run_config,
                                        flower_given(args, toml))  # fraction-train...
        core = flower_core(server, flower.ref, out_dir=out, run_config=flower.run_config,
                           given=given_keys(args, toml),
                           extra_config={"run": dataclasses.asdict(run)})
        server = core.config  # with the settings the app's config suggests
    else:
        core = build_core(server, task, out_dir=out,
                          extra_config={"run": dataclasses.asdict(run)})
    progress = Progress(server.max_versions, quiet=quiet)
    interrupted = threading.Event()
    with ServerThread(core) as srv, on_sigint(interrupted, quiet), live:
        if not quiet:
            print(f"aggregator listening on {srv.address}", file=sys.stderr)
        live.serving(srv.address, core.telemetry)  # metrics endpoint, OUT/murmura.pid
        dashboard = None
        plan = plan_for(args)
        if plan is not None:  # after the fork above: a thread serving the run's web page
            dashboard = start_live(plan, core, out, call=srv.call)
            announce(dashboard, stream=sys.stderr)
        clients = launcher.start(srv.address)
        try:
            finished = _watch(srv, core, progress, clients, run.timeout_s, interrupted)
        finally:
            progress.close()
            if interrupted.is_set():  # tell clients to stop; what ran is summarised below
                srv.call(core.stop)
            failed = _stop_clients(clients, 5.0 if interrupted.is_set() else 30.0)
            failed = sorted(set(failed) | set(launcher.errors))  # threads that raised too
        metrics = srv.call(lambda: dict(core.last_metrics))
        if dashboard is not None:
            srv.call(dashboard.cancel_poster)
    assert core.recorder is not None  # build_core with an out_dir records the run
    summary = core.recorder.finish({"wall_s": time.monotonic() - t0,
                                    "clients_failed": len(failed),
                                    "interrupted": interrupted.is_set()})
    failure = launcher.why_failed(failed) if failed and not interrupted.is_set() else ""
    if failure:  # one line naming the cause and the client's log (not "see its log")
        print(f"murmura run: {failure}", file=sys.stderr)
    if interrupted.is_set():
        print(f"interrupted at version {metrics.get('version', 0)}", file=sys.stderr)
    elif not finished and not failure:
        why = "timeout" if time.monotonic() - t0 >= run.timeout_s else "clients exited"
        print(f"run did not finish ({why}) at version {metrics.get('version', 0)}",
              file=sys.stderr)
    print(result_line(summary, metrics, summary["wall_s"]))
    written = [f"{out}/{name}" for name in ("metrics.jsonl", "summary.json", "accuracy.png")
               if (out / name).exists()]
    print(f"results: {', '.join(written)}")
    if dashboard is not None:
        dashboard.stop()
    if interrupted.is_set():
        return 130
    if not finished and failure:  # the clients failed (a bad app, an unreachable server...)
        return 2
    return 0 if finished and not failed else 1


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
def on_sigint(event: threading.Event, quiet: bool = False, *,
              what: str = "stopping the clients") -> Iterator[None]:
    """While inside: the first Ctrl-C sets ``event`` (the run stops and writes its summary and
    plot); a second one interrupts at once. ``murmura run`` and ``murmura simulate`` stop this
    way, between steps, rather than by an exception raised wherever the signal lands (in the
    middle of a torch transform, that can leave torch's own state inconsistent)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        event.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not quiet:
            print(f"\ninterrupted: {what} and writing the summary (Ctrl-C again to quit at "
                  f"once)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_clients(clients: list[Any], grace_s: float = 30.0) -> list[int]:
    """Wait for clients to leave after the server's STOP; end stragglers. Returns the indices
    of the client processes that failed (threads report theirs to the launcher)."""
    deadline = time.monotonic() + grace_s
    failed: list[int] = []
    for index, c in enumerate(clients):
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
            failed.append(index)
            log.info("client process %d exited with code %s", index, code)
    return failed
