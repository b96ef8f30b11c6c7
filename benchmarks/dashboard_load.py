"""The aggregator's RPC latency while web dashboards watch it (issue 35).

One aggregator runs in its own process, as ``murmura server --dashboard`` runs it: the gRPC
server on its event loop, the dashboard (Starlette and uvicorn) on its own thread and loop,
and a task on the aggregator's loop posting the telemetry's snapshot to it twice a second.
Meanwhile, from other processes:

* a **load** — 100 clients joined, 2 threads pushing small dense updates round-robin (async
  rounds, a version every 4 updates), so versions are published and metric rows appended and
  streamed the whole time;
* a **probe** — one session asking ``GetTask`` every 10 ms, timed on the client side
  (loopback, so the time is the server's answer plus two local socket hops);
* for the third case, **100 dashboard pages** — 100 server-sent event streams open at once,
  each reading every update (a snapshot and the new rows, about once a second).

Three cases: no dashboard at all; a dashboard nobody watches; a dashboard with 100 streams
(and the ablation below).
Each case runs :data:`REPEATS` times, the cases rotating in order, with a fresh server each
time; p50 and p99 are taken over the probes pooled across repeats, and the median of the
repeats' p99 is shown too (every repeat's own figures are in the JSON). The targets compare the
third case with the first: p99 may grow by 20 % plus 2 ms. The slack is there because a
loopback p99 on a shared 2-core machine moves by a millisecond or two between identical runs
(the two cases without streams show how much).

Streams are woken in groups spread over 0.3 s of each tick (server/dashboard/app.py,
``STAGGER_GROUPS``): written all at once, a hundred streams hold the interpreter lock for
milliseconds in one go while the aggregator, in the same process, waits for it. A fourth case
wakes them all at once, to show what the spreading buys (not a target).

Run: ``python benchmarks/dashboard_load.py [--quick | --smoke]``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
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

from benchmarks._report import Column, Report, parse_args, progress  # noqa: E402

NAME = "dashboard_load"
MODEL_SIZE = 10_000
CLIENTS = 100
PUSHERS = 2
PUSH_PERIOD_S = 0.02          # per pusher: ~100 updates/s in all, ~25 versions/s
BUFFER_SIZE = 4
PROBE_PERIOD_S = 0.01
STREAMS = 100
PHASE_S = 12.0
WARM_UP_S = 2.0
REPEATS = 5
#: the target: p99 with the streams <= RATIO x p99 without a dashboard + SLACK_MS
RATIO, SLACK_MS = 1.2, 2.0
CASES = ("no dashboard", "dashboard, 0 streams")


def _sizes(args: Any) -> dict[str, Any]:
    if args.smoke:
        return {"phase_s": 1.0, "warm_up_s": 0.5, "repeats": 1, "streams": 10, "clients": 10}
    if args.quick:
        return {"phase_s": 8.0, "warm_up_s": 1.0, "repeats": 2, "streams": STREAMS,
                "clients": CLIENTS}
    return {"phase_s": PHASE_S, "warm_up_s": WARM_UP_S, "repeats": REPEATS, "streams": STREAMS,
            "clients": CLIENTS}


# -- the server process ------------------------------------------------------------------------


def _server_main(conn: Any, dashboard: bool, out: str, stagger: bool = True) -> None:
    """An aggregator of a MODEL_SIZE vector (and its dashboard); answers 'stats' and 'stop'.
    ``stagger=False`` wakes all of a tick's streams at once (the ablation)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    if not stagger:
        from murmura.server.dashboard import app

        app.STAGGER_GROUPS = 1
    from murmura.dashboard import start_live
    from murmura.protocols import ModelSpec, TensorSpec
    from murmura.server import AggregatorCore, RunRecorder, ServerConfig, ServerThread
    from murmura.server.dashboard import plan_bind

    # The load generator is not a hostile client: no rate limits, no identities.
    cfg = ServerConfig.from_flat(address="127.0.0.1:0", mode="async", buffer_size=BUFFER_SIZE,
                                 min_clients=1, max_versions=10**9, max_staleness=10**9,
                                 workers=0, require_identity=False, push_per_s=0.0,
                                 join_per_s=0.0)
    core = AggregatorCore(cfg, ModelSpec((TensorSpec("w", (MODEL_SIZE,)),)),
                          np.zeros(MODEL_SIZE, np.float32), recorder=RunRecorder(out),
                          evaluator=lambda p: {"accuracy": float(np.tanh(np.abs(p).mean())),
                                               "loss": float(np.abs(p).mean())},
                          checkpoint_path=None)
    srv = ServerThread(core, "127.0.0.1:0").start()
    live = start_live(plan_bind("127.0.0.1:0"), core, Path(out), call=srv.call) \
        if dashboard else None
    conn.send((srv.address, live.server.port if live is not None else 0))
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            conn.send({"updates": srv.call(lambda: core.traffic.updates),
                       "version": srv.call(lambda: core.version),
                       "streams": live.server.hub.streams if live is not None else 0})
        elif cmd == "stop":
            if live is not None:
                srv.call(live.cancel_poster)
                live.stop()
            srv.stop(grace=None)
            conn.send("stopped")
            return


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    def __init__(self, dashboard: bool, stagger: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.out = tempfile.mkdtemp(prefix="murmura-dashboard-load-")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, args=(child, dashboard, self.out,
                                                                  stagger))
        self.proc.start()
        deadline = time.monotonic() + 120
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server process did not start (exit code "
                                   f"{self.proc.exitcode})")
        self.address, self.dashboard_port = self.conn.recv()

    def stats(self) -> dict[str, Any]:
        self.conn.send("stats")
        return dict(self.conn.recv())

    def cpu_seconds(self) -> float:
        assert self.proc.pid is not None
        return _cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        try:
            self.conn.send("stop")
            if self.conn.poll(60):
                self.conn.recv()
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


# -- load, probe and dashboard streams (each in its own process) -------------------------------


def _load_main(address: str, clients: int, stop: Any, ready: Any) -> None:
    """``clients`` sessions pushing small dense updates round-robin from PUSHERS threads."""
    from murmura.client import GrpcTransport, RemoteError
    from murmura.protocols import DeviceProfile, UpdateHeader

    transports = [GrpcTransport(address, timeout_s=60) for _ in range(PUSHERS)]
    joined = [transports[i % PUSHERS].join(f"load-{i:03d}", DeviceProfile(steps_per_s=10 + i))
              for i in range(clients)]
    fingerprint = joined[0][1].fingerprint()
    sessions = [result.session for result, _ in joined]
    payload = (np.random.default_rng(0).standard_normal(MODEL_SIZE) * 1e-3).astype("<f4")
    data = payload.tobytes()
    ready.set()

    def push(k: int) -> None:
        t, mine = transports[k], sessions[k::PUSHERS]
        i = 0
        while not stop.is_set():
            session = mine[i % len(mine)]
            i += 1
            header = UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=0,
                                  round=0, num_examples=10, codec="dense-f32",
                                  payload_bytes=len(data), spec_fingerprint=fingerprint)
            try:
                t.push(header, data)
            except RemoteError as exc:  # back-pressure: wait as the server asks
                stop.wait(exc.retry_after_s or 0.1)
            stop.wait(PUSH_PERIOD_S)

    threads = [threading.Thread(target=push, args=(k,)) for k in range(PUSHERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in transports:
        t.close()


def _probe_main(address: str, seconds: float, warm_up_s: float, out: Any) -> None:
    from murmura.client import GrpcTransport
    from murmura.protocols import DeviceProfile

    t = GrpcTransport(address, timeout_s=60)
    session = t.join("probe", DeviceProfile())[0].session
    times: list[float] = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < warm_up_s + seconds:
        t.task(session, 0.0)
        took = time.perf_counter() - now
        if now - start >= warm_up_s:
            times.append(1e3 * took)
        time.sleep(PROBE_PERIOD_S)
    t.close()
    out.send(times)


def _streams_main(port: int, count: int, stop: Any, ready: Any, out: Any) -> None:
    """``count`` event streams held open and read until ``stop``; sends ([updates, bytes]
    of each stream, flattened) and the seconds all were open."""

    async def one(counts: list[int], index: int, opened: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"stream {index} refused: {status!r}")
        opened[0] += 1
        marker, carry = b"event: update", b""
        try:  # whole chunks, not lines: a browser's cost is not the benchmark's to pay here
            while not stop.is_set():
                try:
                    chunk = await asyncio.wait_for(reader.read(1 << 16), 0.5)
                except asyncio.TimeoutError:
                    continue
                if not chunk:
                    break
                counts[2 * index + 1] += len(chunk)
                counts[2 * index] += (carry + chunk).count(marker)
                carry = chunk[-(len(marker) - 1):]
        finally:
            writer.close()

    async def main() -> tuple[list[int], float]:
        counts = [0] * (2 * count)
        opened = [0]
        tasks = [asyncio.create_task(one(counts, i, opened)) for i in range(count)]
        while opened[0] < count:
            await asyncio.sleep(0.05)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
        ready.set()
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        return counts, time.perf_counter() - t0

    out.send(asyncio.run(main()))


# -- one measurement ---------------------------------------------------------------------------


def measure(case: str, sizes: dict[str, Any], *, dashboard: bool, streams: int,
            stagger: bool = True) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    server = ServerProcess(dashboard, stagger)
    stop, ready = ctx.Event(), ctx.Event()
    load = ctx.Process(target=_load_main, args=(server.address, sizes["clients"], stop, ready))
    readers = None
    try:
        load.start()
        if not ready.wait(120):
            raise RuntimeError("the load process did not join")
        rx_streams = None
        if streams:
            opened, (rx_streams, tx_streams) = ctx.Event(), ctx.Pipe(duplex=False)
            readers = ctx.Process(target=_streams_main, args=(
                server.dashboard_port, streams, stop, opened, tx_streams))
            readers.start()
            if not opened.wait(120):
                raise RuntimeError("the dashboard streams did not open")
        rx, tx = ctx.Pipe(duplex=False)
        probe = ctx.Process(target=_probe_main, args=(server.address, sizes["phase_s"],
                                                      sizes["warm_up_s"], tx))
        before = server.stats()
        probe.start()
        time.sleep(sizes["warm_up_s"])
        cpu0, t0 = server.cpu_seconds(), time.perf_counter()
        times: list[float] = rx.recv()
        cpu, elapsed = server.cpu_seconds() - cpu0, time.perf_counter() - t0
        after = server.stats()
        probe.join(30)
        open_streams = after["streams"]
        stop.set()
        counts, open_s = rx_streams.recv() if rx_streams is not None else ([], 0.0)
        total_s = elapsed + sizes["warm_up_s"]
        updates = counts[0::2]
        row: dict[str, Any] = {
            "case": case, "streams": streams, "open_streams": open_streams,
            "probes": len(times), "p50_ms": float(np.percentile(times, 50)),
            "p99_ms": float(np.percentile(times, 99)), "max_ms": float(max(times)),
            "server_cpu_pct": 100 * cpu / elapsed,
            "updates_per_s": (after["updates"] - before["updates"]) / total_s,
            "versions": after["version"],
            "events_per_stream_s": (float(np.mean(updates)) / open_s) if updates else None,
            "min_events_per_stream_s": (min(updates) / open_s) if updates else None,
            "stream_kb_per_s": (sum(counts[1::2]) / 1e3 / open_s) if counts else None,
            "latencies_ms": times,
        }
        return row
    finally:
        stop.set()
        for proc in (load, readers):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
        server.stop()


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from a case's repeats: percentiles over every probe of every repeat."""
    times = [t for r in runs for t in r["latencies_ms"]]
    row = {k: v for k, v in runs[0].items() if k in ("case", "streams")}
    row.update({"probes": len(times), "p50_ms": float(np.percentile(times, 50)),
                "p99_ms": float(np.percentile(times, 99)),
                "median_p99_ms": float(np.median([r["p99_ms"] for r in runs])),
                "worst_run_p99_ms": max(r["p99_ms"] for r in runs),
                "server_cpu_pct": float(np.median([r["server_cpu_pct"] for r in runs])),
                "updates_per_s": float(np.median([r["updates_per_s"] for r in runs]))})
    events = [r["min_events_per_stream_s"] for r in runs if r["min_events_per_stream_s"]
              is not None]
    row["min_events_per_stream_s"] = min(events) if events else None
    kb = [r["stream_kb_per_s"] for r in runs if r["stream_kb_per_s"] is not None]
    row["stream_kb_per_s"] = float(np.median(kb)) if kb else None
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, __doc__.split("\n\n")[0], argv)
    sizes = _sizes(args)
    report = Report(NAME, quick=args.quick, params={
        **sizes, "model_size": MODEL_SIZE, "pushers": PUSHERS, "push_period_s": PUSH_PERIOD_S,
        "buffer_size": BUFFER_SIZE, "probe_period_s": PROBE_PERIOD_S, "ratio": RATIO,
        "slack_ms": SLACK_MS})
    cases = {CASES[0]: (False, 0, True), CASES[1]: (True, 0, True),
             f"dashboard, {sizes['streams']} streams": (True, sizes["streams"], True),
             f"dashboard, {sizes['streams']} streams, not staggered":
                 (True, sizes["streams"], False)}
    names = list(cases)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in names}
    for r in range(sizes["repeats"]):
        for case in names[r % len(names):] + names[:r % len(names)]:
            dashboard, streams, stagger = cases[case]
            row = measure(case, sizes, dashboard=dashboard, streams=streams, stagger=stagger)
            runs[case].append(row)
            progress(f"repeat {r + 1}/{sizes['repeats']}, {case}: GetTask p50 "
                     f"{row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms over {row['probes']} "
                     f"probes; server CPU {row['server_cpu_pct']:.0f} %"
                     + (f"; {row['open_streams']} streams, at least "
                        f"{row['min_events_per_stream_s']:.2f} updates/s each"
                        if streams else ""))
    rows = [pooled(runs[c]) for c in names]
    report.table("GetTask latency while dashboards watch (loopback)", [
        Column("case", "case"),
        Column("probes", "probes"),
        Column("p50_ms", "GetTask p50 ms", "{:.2f}"),
        Column("p99_ms", "GetTask p99 ms", "{:.2f}"),
        Column("median_p99_ms", "median run's p99 ms", "{:.2f}"),
        Column("worst_run_p99_ms", "worst run's p99 ms", "{:.2f}"),
        Column("server_cpu_pct", "server CPU %", "{:.0f}"),
        Column("updates_per_s", "updates/s taken", "{:.0f}"),
        Column("min_events_per_stream_s", "updates/s per stream (min)", "{:.2f}"),
        Column("stream_kb_per_s", "stream kB/s (all)", "{:.1f}"),
    ], rows)
    for case in names:  # every repeat, without the raw latencies (those stay in memory)
        for i, one in enumerate(runs[case]):
            report.rows.append({"table": "repeats", "repeat": i + 1,
                                **{k: v for k, v in one.items() if k != "latencies_ms"}})
    base, streamed = rows[0], rows[2]
    report.target(f"GetTask p99 with {sizes['streams']} dashboard streams, median of the "
                  f"repeats (<= {RATIO:g} x the same without a dashboard + {SLACK_MS:g} ms)",
                  streamed["median_p99_ms"], "<=", RATIO * base["median_p99_ms"] + SLACK_MS,
                  unit="ms")
    report.target(f"GetTask p99 with {sizes['streams']} dashboard streams, all probes pooled "
                  f"(<= {RATIO:g} x the same without a dashboard + {SLACK_MS:g} ms)",
                  streamed["p99_ms"], "<=", RATIO * base["p99_ms"] + SLACK_MS, unit="ms")
    report.target("updates each dashboard stream received per second (slowest stream)",
                  streamed["min_events_per_stream_s"] or float("nan"), ">=", 0.8)
    report.note(
        f"One aggregator process (async rounds of {BUFFER_SIZE} updates of a {MODEL_SIZE:,}-"
        f"value model, decoding in-process) with {sizes['clients']} clients joined and "
        f"{PUSHERS} threads pushing round-robin, a probe process timing GetTask every "
        f"{1e3 * PROBE_PERIOD_S:g} ms for {sizes['phase_s']:g} s after a {sizes['warm_up_s']:g} s "
        f"warm-up, and for the last two cases a process holding {sizes['streams']} server-sent "
        f"event streams open on the dashboard, reading every update (the last case wakes "
        f"them all at once at each tick instead of in 10 groups over 0.3 s). The dashboard "
        f"runs as `murmura server --dashboard` runs it: its own thread and event loop, fed a "
        f"telemetry snapshot "
        f"every 0.5 s by a task on the aggregator's loop. {sizes['repeats']} repeats per case, "
        f"rotating; percentiles over all probes of a case, and the median of the repeats' p99 "
        f"(one repeat disturbed by another job on the machine moves the pooled p99, not the "
        f"median). The targets allow p99 to grow by "
        f"{100 * (RATIO - 1):.0f} % plus {SLACK_MS:g} ms: loopback p99 on this shared 2-core "
        f"machine moves by about that much between identical runs (compare the first two "
        f"rows). All processes share the machine's 2 cores, so the streams' reader and the "
        f"dashboard's encoding compete with the aggregator for CPU, as they would on a small "
        f"server.")
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
