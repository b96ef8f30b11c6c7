"""The gateway's serial CPU per update: what the aggregator process itself spends on a push.

One durable aggregator runs in its own process (as ``murmura server --durable`` does), with
decoding in 2 worker processes, so that what is left in the aggregator's process is the
gateway's part of every update; once as it is by default, once with 2 receiver processes
(``--receivers 2``, server/receivers.py) that take the push streams off the gateway. Its
part: the payload received into its slab (gRPC's own threads and the event loop; a hand-off
from a receiver instead), the header checks, precheck / begin / finish, the spool write
(spool thread), the group commit (store thread) and the answer. 4 pusher threads in this
process send pre-encoded int8 updates of a 10M-value model (the int8 load of
``benchmarks/serverless.py``) as fast as the server takes them. The server runs async with a
buffer larger than the load, so nothing is published: the publisher's fold is the other part
of the serial path, measured by ``benchmarks/serverless.py``.

CPU time per thread comes from ``/proc/<pid>/task/<tid>/stat``, each thread named by the
Python thread that runs on it (the gRPC core's own threads have no Python name). The worker
and receiver processes are not counted: they are the parallel part.

Reported per update: CPU ms of the event loop, the gRPC core threads, the spool writer, the
store thread and the rest, their sum (the gateway's serial work), and the workers' decode for
comparison. Run ``python benchmarks/gateway.py [--quick | --smoke]``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._proc import cpu_seconds, tree_cpu_seconds  # noqa: E402
from benchmarks._report import Column, Report, parse_args, progress  # noqa: E402

PUSHERS = 4
SIZE = 10_000_000
SMOKE_SIZE = 100_000
#: Thread names of the aggregator process, grouped as the report shows them.
GROUPS = {"murmura-aggregator": "event loop", "murmura-spool": "spool writer",
          "murmura-store": "store (group commit)", "murmura-publisher": "publisher"}
NATIVE = "gRPC core threads"
#: The gateway's serial CPU per update, as a share of the update's CPU (gateway + decode).
#: The issue's budget for the whole serial path (gateway + publisher) is 5 % for int8.
GATEWAY_SHARE_GOAL = 0.05
#: CPU ms per MB spooled of the spool writer and the group commit together (1.57 before the
#: spool wrote payloads directly: the page-cache copy on the project's VM).
SPOOL_MS_PER_MB_GOAL = 0.15


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process, by group (see :data:`GROUPS`)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        name = names.get(int(tid))
        group = GROUPS.get(name or "", NATIVE if name is None else "other Python threads")
        out[group] = out.get(group, 0.0) + cpu_seconds("self", tid)
    return out


def _server_main(conn: Any, size: int, out_dir: str, receivers: int = 0) -> None:
    """A durable aggregator with 2 decoding workers (and ``receivers`` receiver processes);
    answers 'cpu' and 'stop' on ``conn``."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from murmura.protocols import ModelSpec, TaskSettings, TensorSpec
    from murmura.server import ServerConfig, ServerThread
    from murmura.server.app import assemble_core

    # The load generator joins and pushes raw, unsigned (legacy ids; docs/security.md), and
    # it is not a hostile client: no per-client rate limit.
    cfg = ServerConfig.from_flat(address="127.0.0.1:0", train=TaskSettings(codec="int8"),
                                 require_identity=False, push_per_s=0.0, mode="async",
                                 min_clients=1, max_versions=1, buffer_size=10**9,
                                 max_staleness=10**9, workers=-1, max_workers=2,
                                 max_payload_mb=256, receivers=receivers)
    spec = ModelSpec((TensorSpec("w", (size,)),))
    core = assemble_core(cfg, spec, np.zeros(size, np.float32), out_dir=out_dir, durable=True)
    srv = ServerThread(core, "127.0.0.1:0").start()
    conn.send(srv.address)
    while True:
        cmd = conn.recv()
        if cmd == "cpu":
            store = core.store
            workers = tree_cpu_seconds(os.getpid(), include_root=False)
            pids = srv.call(lambda: srv.server.receivers.pids
                            if srv.server.receivers is not None else [])
            conn.send({"threads": thread_cpu(), "workers": workers,
                       "receivers": sum(cpu_seconds(pid) for pid in pids),
                       "updates": srv.call(lambda: core.traffic.updates),
                       "commits": getattr(store, "commits", 0),
                       "committed_ops": getattr(store, "committed_ops", 0)})
        elif cmd == "stop":
            srv.stop(grace=None)
            conn.send("stopped")
            return


def make_payloads(size: int, count: int) -> list[bytes]:
    """``count`` int8 updates (4 distinct ones, reused round-robin)."""
    from murmura.protocols import create_codec

    codec = create_codec("int8", {})
    rng = np.random.default_rng(0)
    distinct = [codec.encoder(size, seed=i).encode(
        (rng.standard_normal(size) * 1e-3).astype(np.float32)) for i in range(min(count, 4))]
    return [distinct[i % len(distinct)] for i in range(count)]


def push_load(address: str, payloads: list[bytes]) -> float:
    """Push every payload from :data:`PUSHERS` threads; seconds from first send to last answer."""
    from murmura.client import GrpcTransport
    from murmura.protocols import DeviceProfile, UpdateHeader

    transports = [GrpcTransport(address, timeout_s=600) for _ in range(PUSHERS)]
    joins = [t.join(f"pusher-{i}", DeviceProfile()) for i, t in enumerate(transports)]
    fingerprint = joins[0][1].fingerprint()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        t, session = transports[i], joins[i][0].session
        try:
            for payload in payloads[i::PUSHERS]:
                t.push(UpdateHeader(session=session, update_id=uuid.uuid4().hex[:12],
                                    base_version=0, num_examples=10, codec="int8",
                                    payload_bytes=len(payload), spec_fingerprint=fingerprint),
                       payload)
        except BaseException as exc:  # reported below: a refused push voids the run
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(PUSHERS)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    for t in transports:
        t.close()
    if errors:
        raise RuntimeError(f"a push failed, so the run measures nothing: {errors[0]}")
    return elapsed


def one_run(size: int, payloads: list[bytes], workdir: Path, receivers: int = 0
            ) -> dict[str, Any]:
    """One server, a warm-up push per pusher, then the load; CPU ms per update by group."""
    out_dir = tempfile.mkdtemp(prefix="gateway-", dir=workdir)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_server_main, args=(child, size, out_dir, receivers))
    proc.start()
    try:
        if not conn.poll(120):
            raise RuntimeError(f"the server process did not start (exit {proc.exitcode})")
        address = conn.recv()
        push_load(address, payloads[:PUSHERS])  # workers started, slabs and buffers mapped
        conn.send("cpu")
        before = conn.recv()
        elapsed = push_load(address, payloads)
        conn.send("cpu")
        after = conn.recv()
        conn.send("stop")
        conn.poll(60) and conn.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        shutil.rmtree(out_dir, ignore_errors=True)
    n = len(payloads)
    taken = after["updates"] - before["updates"]
    if taken != n:
        raise RuntimeError(f"the server counted {taken} of {n} updates")
    groups = sorted(set(before["threads"]) | set(after["threads"]))
    per = {g: 1e3 * (after["threads"].get(g, 0.0) - before["threads"].get(g, 0.0)) / n
           for g in groups}
    commits = after["commits"] - before["commits"]
    return {"per_thread_ms": per, "gateway_ms": sum(per.values()),
            "workers_ms": 1e3 * (after["workers"] - before["workers"]) / n,
            "receivers_ms": 1e3 * (after["receivers"] - before["receivers"]) / n,
            "updates_s": n / elapsed, "pushes": n, "receivers": receivers,
            "ops_per_commit": (after["committed_ops"] - before["committed_ops"]) / commits
            if commits else None}


#: receiver processes of the configuration the target is measured on
RECEIVERS = 2


def run(argv: list[str] | None = None) -> int:
    args = parse_args("gateway", "The gateway's serial CPU per update", argv)
    size = SMOKE_SIZE if args.smoke else SIZE
    pushes = 8 if args.smoke else 60 if args.quick else 200
    repeats = 1 if args.smoke else 2 if args.quick else 3
    workdir = Path(tempfile.mkdtemp(prefix="murmura-gateway-"))
    report = Report("gateway", quick=args.quick, params={
        "pushers": PUSHERS, "model_size": size, "codec": "int8", "pushes_per_run": pushes,
        "repeats": repeats, "decoding": "2 worker processes", "state": "durable (SQLite, spool)",
        "receivers": [0, RECEIVERS]})
    payloads = make_payloads(size, pushes)
    runs: dict[int, list[dict[str, Any]]] = {0: [], RECEIVERS: []}
    try:
        for r in range(repeats):
            for receivers in runs:  # alternated, so both see the same machine
                where = f"{receivers} receivers" if receivers else "the gateway receives"
                progress(f"run {r + 1}/{repeats} ({where}): {pushes} int8 pushes of "
                         f"{size:,} values")
                runs[receivers].append(one_run(size, payloads, workdir, receivers))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # the least disturbed run of each configuration
    best = {k: min(v, key=lambda x: x["gateway_ms"]) for k, v in runs.items()}
    groups = sorted(set(best[0]["per_thread_ms"]) | set(best[RECEIVERS]["per_thread_ms"]),
                    key=lambda g: -best[0]["per_thread_ms"].get(g, 0.0))
    rows = [{"part": g, **{f"ms_{k}": best[k]["per_thread_ms"].get(g, 0.0) for k in best}}
            for g in groups]
    rows.append({"part": "gateway in all (serial)",
                 **{f"ms_{k}": best[k]["gateway_ms"] for k in best}})
    rows.append({"part": "workers and receivers (parallel)",
                 **{f"ms_{k}": best[k]["workers_ms"] for k in best}})
    rows.append({"part": "of it receivers", **{f"ms_{k}": best[k]["receivers_ms"] for k in best}})
    report.table(f"CPU ms per int8 update of {size:,} values ({len(payloads[0]) / 1e6:.1f} MB), "
                 f"best of {repeats} runs", [
                     Column("part", "thread(s)"),
                     Column("ms_0", "gateway receives", "{:.2f}"),
                     Column(f"ms_{RECEIVERS}", f"{RECEIVERS} receiver processes", "{:.2f}")],
                 rows)
    shares = {k: b["gateway_ms"] / (b["gateway_ms"] + b["workers_ms"]) for k, b in best.items()}
    mb = len(payloads[0]) / 1e6
    spool_ms = min((x["per_thread_ms"].get(GROUPS["murmura-spool"], 0.0)
                    + x["per_thread_ms"].get(GROUPS["murmura-store"], 0.0)) / mb
                   for x in runs[RECEIVERS])
    report.target(f"gateway CPU per update as a share of the update's CPU (gateway + decode + "
                  f"receive), int8 10M, {RECEIVERS} receiver processes", shares[RECEIVERS], "<=",
                  GATEWAY_SHARE_GOAL, unit="x",
                  detail=f"{shares[0]:.2f} when the gateway receives itself")
    report.target("spool writer and group commit CPU per MB spooled", spool_ms, "<=",
                  SPOOL_MS_PER_MB_GOAL, unit="ms")
    for k, label in ((0, "the gateway receiving"), (RECEIVERS, f"{RECEIVERS} receivers")):
        each_ms = ", ".join(f"{x['gateway_ms']:.2f}" for x in runs[k])
        each_rate = ", ".join(f"{x['updates_s']:.1f}" for x in runs[k])
        report.note(f"With {label}, every run (gateway ms per update): {each_ms}; updates/s "
                    f"{each_rate}; ops per group commit {best[k]['ops_per_commit'] or 0:.1f}.",
                    after_tables=True)
    report.note("The pushers run on the same machine; on a shared 2-core VM the gateway's "
                "threads also wait for a CPU, which costs wall time, not CPU time. When the "
                "gateway receives, most of its CPU is gRPC's own receive: its core threads read "
                "the socket and its event-loop side copies every message into a Python bytes "
                "object (the chunk size, 256 KiB to 3 MiB, changes nothing). With `--receivers` "
                "that work runs in receiver processes on their own port, which land the "
                "payload in the tier's shared memory (server/receivers.py); the gateway keeps "
                "the header checks, the spool, the hand-off to the workers and the answer.",
                after_tables=True)
    report.table("every run", [Column("receivers", "receivers"), Column("run", "run"),
                               Column("gateway_ms", "gateway ms/update", "{:.2f}"),
                               Column("workers_ms", "parallel ms/update", "{:.2f}"),
                               Column("updates_s", "updates/s", "{:.1f}")],
                 [{"run": i + 1, **{k: x[k] for k in ("receivers", "gateway_ms", "workers_ms",
                                                       "updates_s")},
                   "per_thread_ms": x["per_thread_ms"]}
                  for per in runs.values() for i, x in enumerate(per)])
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    sys.exit(run())
