"""``murmura server``: serve the aggregator (or, with ``--role leaf``, a leaf aggregator) until
its last version or SIGINT/SIGTERM, then keep telling clients to stop for ``--linger-s``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmura.common import configure_logging, task_and_server
from murmura.config import read_toml
from murmura.dashboard import announce, plan_for, start_live
from murmura.progress import Progress, result_line
from murmura.runs import LiveRun
from murmura.server.outputs import read_rows

if TYPE_CHECKING:
    from murmura.server import ServerConfig
    from murmura.tasks import TaskConfig

log = logging.getLogger("murmura")

__all__ = ["cmd_server"]


def cmd_server(args: argparse.Namespace) -> int:
    configure_logging(args, logging.INFO)
    toml = read_toml(args.config)
    task, server = task_and_server(args, toml)
    return asyncio.run(_serve(server, task, args))


async def _serve(server_cfg: ServerConfig, task: TaskConfig, args: argparse.Namespace) -> int:
    from murmura.server import AggregatorServer, build_core

    t0 = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the address is announced
        loop.add_signal_handler(sig, stop.set)
    security = server_cfg.security
    if security.tls_cert:  # check the certificate files before loading anything
        from murmura.protocols.tls import server_credentials

        server_credentials(security.tls_cert, security.tls_key, security.client_ca or None)
    if server_cfg.leaf.role == "leaf":
        return await _serve_leaf(server_cfg, task, args, stop)
    out = Path(args.out)
    live = LiveRun(out, "server", server_cfg.metrics_address, quiet=args.quiet > 0)  # binds now
    resume = args.resume
    if resume == "auto":
        candidate = out / "checkpoint.npz"
        resume = str(candidate) if candidate.exists() else None
        if args.durable and (out / "state.db").exists():
            resume = None  # the durable state is the fuller record; it is used by itself
    # Durable (the default): OUT/state.db keeps what a restart needs, and a server started on
    # an OUT that holds state resumes from it (it logs "resumed from the durable state").
    if args.flower_app:  # the model a Flower client starts from (docs/flower.md)
        from murmura.clients import flower_given, flower_server_settings
        from murmura.server.flower import flower_core, given_keys

        toml = read_toml(args.config)
        server_cfg = flower_server_settings(server_cfg, args.flower_app, args.run_config,
                                            flower_given(args, toml))  # fraction-train...
        core = flower_core(server_cfg, args.flower_app, out_dir=out, resume=resume,
                           durable=args.durable, run_config=args.run_config,
                           given=given_keys(args, toml))
        server_cfg = core.config  # with the settings the app's config suggests
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
    pushes = f" (pushes: port {srv.push_port}, {server_cfg.tier.receivers} receivers)" \
        if srv.push_port else ""
    print(f"murmura server listening on {srv.address}{pushes}", flush=True)
    dashboard = None
    plan = plan_for(args, tls_cert=security.tls_cert, tls_key=security.tls_key)
    if plan is not None:  # a read-only web page of the run, served from its own thread
        try:
            dashboard = start_live(plan, core, out)
        except BaseException:
            await srv.stop(grace=None)
            raise
        announce(dashboard)
    live.serving(srv.address, core.telemetry)  # metrics endpoint, OUT/murmura.pid
    progress = Progress(server_cfg.max_versions, quiet=args.quiet > 0)
    reporter = asyncio.ensure_future(_report(core, progress))
    done = asyncio.ensure_future(srv.wait_done())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
    reporter.cancel()
    _show_versions(core, progress)  # the versions made since the last poll
    progress.close()
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
    if dashboard is not None:
        dashboard.cancel_poster()  # the page shows the run finished until the process exits
    await srv.stop(grace=1.0)
    live.close()
    assert core.recorder is not None  # build_core with an out_dir records the run
    wall_s = time.monotonic() - t0
    summary = core.recorder.finish({"wall_s": wall_s})
    print(result_line(summary, dict(core.last_metrics), wall_s), flush=True)
    print(f"stopped at version {summary['versions']}; results in {out}", flush=True)
    if dashboard is not None:
        dashboard.stop()
    return 0


def _show_versions(core: Any, progress: Progress) -> None:
    """A line for each version made since the last one shown. Several may have come between
    two polls (a fast run): those are read back from the run's rows, so none is skipped."""
    if progress.quiet:
        return
    row = dict(core.last_metrics)
    version, shown = int(row.get("version", 0)), progress.last_version
    if version <= shown:
        return
    if version > shown + 1 and core.recorder is not None:
        # read the file, not recorder.rows: that flushes the recorder's file from this thread
        # while the publisher writes to it (record() flushes each row itself)
        for earlier in read_rows(core.recorder.metrics_path):
            if shown < int(earlier.get("version", 0)) < version:
                progress.update(earlier)
    progress.update(row)


async def _report(core: Any, progress: Progress) -> None:
    """Until cancelled: the joined clients while none has pushed, then a line per version
    (read on the event loop that owns the core, so no lock is needed)."""
    t0 = time.monotonic()
    while True:
        if int(core.last_metrics.get("version", 0)) > 0:
            _show_versions(core, progress)
        else:
            joined = len(core.sessions)
            progress.starting(f"waiting for clients: {joined} joined", key=joined,
                              elapsed=time.monotonic() - t0)
        await asyncio.sleep(0.25)


async def _serve_leaf(server_cfg: ServerConfig, task: TaskConfig, args: argparse.Namespace,
                      stop: asyncio.Event) -> int:
    from murmura.server.leaf import Leaf

    leaf = Leaf(server_cfg, task, out_dir=Path(args.out))
    live = LiveRun(args.out, "server --role leaf", server_cfg.metrics_address,
                   quiet=args.quiet > 0)
    t0 = time.monotonic()
    await leaf.start()
    live.serving(leaf.address, leaf.core.telemetry if leaf.core is not None else None)
    print(f"murmura leaf listening on {leaf.address} (upstream {server_cfg.leaf.upstream})",
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
    live.close()
    summary = leaf.finish(wall_s=time.monotonic() - t0)  # what it forwarded, not results
    if leaf.link_error is not None:
        print(f"murmura server: the upstream link failed: {leaf.link_error}", file=sys.stderr)
        return 1
    print(f"leaf stopped: forwarded {summary['partials_sent']} partials "
          f"({summary['updates_folded']} updates from {summary['clients']} clients, "
          f"{summary['partial_bytes_sent'] / 1e6:.2f} MB upstream); the results are the "
          f"parent's; this leaf's summary is in {Path(args.out) / 'summary.json'}", flush=True)
    return 0
