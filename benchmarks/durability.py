"""What durable state costs: update intake with and without ``state.db``, under the same load.

A real gRPC aggregator on loopback (async FedBuff, ``buffer_size`` 10, decoding in-process, no
evaluation) takes pushes of pre-encoded dense-f32 updates from concurrent client threads
(``GrpcTransport``, no training), for two model sizes. The baseline is today's non-durable
server writing its metrics and ``checkpoint.npz`` per version; the durable one spools every
payload, commits its counted id and pending row (group commit: one spool ``fsync`` and one
SQLite commit cover every push queued meanwhile) and acknowledges only then, and publishes
each version in one transaction. Both runs of a size are interleaved, best of the repeats.

Measured: updates/s over the whole run, push latency (p50, p95) as the clients see it, and
how many pushes one commit covered. Run ``python benchmarks/durability.py [--quick | --smoke]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress  # noqa: E402

CLIENTS = 8
BUFFER = 10


def one_run(size: int, pushes: int, durable: bool, workdir: Path) -> dict[str, Any]:
    import numpy as np

    from murmura.client import GrpcTransport
    from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
    from murmura.server import ServerConfig, ServerThread
    from murmura.server.app import assemble_core

    spec = ModelSpec((TensorSpec("w", (size,)),))
    out = Path(tempfile.mkdtemp(prefix="durable-" if durable else "plain-", dir=workdir))
    # The load generator joins and pushes raw, unsigned (legacy ids; docs/security.md), and
    # it is not a hostile client: no per-client rate limit.
    config = ServerConfig.from_flat(mode="async", buffer_size=BUFFER, max_staleness=10**6,
                                    max_versions=10**6, workers=0, seed=0, require_identity=False,
                                    push_per_s=0.0)
    core = assemble_core(config, spec, np.zeros(size, np.float32), out_dir=out,
                         durable=durable)
    rng = np.random.default_rng(0)
    payloads = [(0.01 * rng.normal(size=size)).astype("<f4").tobytes() for _ in range(4)]
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    per_client = pushes // CLIENTS
    with ServerThread(core, "127.0.0.1:0") as srv:
        def client(i: int) -> None:
            transport = GrpcTransport(srv.address)
            try:
                session = transport.join(f"c{i}", DeviceProfile())[0].session
                fingerprint = spec.fingerprint()
                mine = []
                for k in range(per_client):
                    payload = payloads[k % len(payloads)]
                    header = UpdateHeader(session=session, update_id=f"c{i}-{k}",
                                          base_version=0, num_examples=10,
                                          codec="dense-f32", payload_bytes=len(payload),
                                          spec_fingerprint=fingerprint)
                    t0 = time.perf_counter()
                    transport.push(header, payload)
                    mine.append(time.perf_counter() - t0)
                with lock:
                    latencies.extend(mine)
            except BaseException as exc:  # reported below: a refused push voids the run
                with lock:
                    errors.append(exc)
            finally:
                transport.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        versions = srv.call(lambda: core.version)
        store = core.store
        commits = (store.commits, store.committed_ops) if store is not None else (0, 0)
    if errors:
        raise RuntimeError(f"a client failed, so the run measures nothing: {errors[0]}")
    latencies.sort()
    n = len(latencies)
    return {"updates_s": n / wall, "p50_ms": 1e3 * latencies[n // 2],
            "p95_ms": 1e3 * latencies[int(0.95 * (n - 1))], "versions": versions,
            "ops_per_commit": commits[1] / commits[0] if commits[0] else None,
            "pushes": n}


def disk_mb_s(workdir: Path, total_mb: int = 200) -> float:
    """Sequential write bandwidth of the disk under ``workdir``, fsynced every 8 MB (the
    ceiling for spooling large payloads)."""
    path = workdir / "probe.bin"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(total_mb):
            f.write(block)
            if i % 8 == 7:
                f.flush()
                os.fsync(f.fileno())
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return total_mb * (1 << 20) / 1e6 / seconds


def measure(workdir: Path, sizes: list[int], pushes: int, repeats: int, probe_mb: int,
            probes: int) -> tuple[list[dict[str, Any]], float]:
    """The disk probe, then plain and durable runs of every size, interleaved: one row per
    size with the best of the repeats, and the disk's fsynced MB/s."""
    rows = []
    disk = max(disk_mb_s(workdir, probe_mb) for _ in range(probes))
    progress(f"disk: {disk:.0f} MB/s sequential, fsynced")
    for size in sizes:
        best: dict[bool, dict[str, Any]] = {}
        for r in range(repeats):
            for durable in (False, True):  # interleaved, best of the repeats
                progress(f"{size:,} floats, {'durable' if durable else 'plain'}, "
                         f"repeat {r + 1}/{repeats}")
                res = one_run(size, pushes, durable, workdir)
                if durable not in best or res["updates_s"] > best[durable]["updates_s"]:
                    best[durable] = res
        plain, dur = best[False], best[True]
        rows.append({"size": size, "payload_kb": 4 * size / 1024,
                     "plain_updates_s": plain["updates_s"], "durable_updates_s":
                     dur["updates_s"], "ratio": dur["updates_s"] / plain["updates_s"],
                     "plain_p50_ms": plain["p50_ms"], "durable_p50_ms": dur["p50_ms"],
                     "plain_p95_ms": plain["p95_ms"], "durable_p95_ms": dur["p95_ms"],
                     "ops_per_commit": dur["ops_per_commit"], "versions": dur["versions"],
                     "spool_mb_s": dur["updates_s"] * 4 * size / 1e6, "disk_mb_s": disk})
    return rows, disk


def run(argv: list[str] | None = None) -> int:
    args = parse_args("durability", "Update intake with and without durable state", argv)
    quick = args.quick
    sizes = [1_000, 10_000] if args.smoke else [10_000, 250_000] if quick else [10_000, 1_000_000]
    pushes = 2 * CLIENTS if args.smoke else 400 if quick else 2_000
    repeats = 1 if args.smoke else 2 if quick else 3
    probe_mb, probes = (8, 1) if args.smoke else (200, 2)
    workdir = Path(tempfile.mkdtemp(prefix="murmura-durability-"))
    fs = os.statvfs(workdir)
    report = Report("durability", quick=quick, params={
        "clients": CLIENTS, "buffer_size": BUFFER, "pushes_per_run": pushes,
        "model_sizes": sizes, "repeats": repeats, "decoding": "in-process (workers 0)",
        "disk": f"{workdir} ({fs.f_bsize}-byte blocks)"})
    try:
        rows, disk = measure(workdir, sizes, pushes, repeats, probe_mb, probes)
    finally:  # each run's state.db, spool and checkpoints (hundreds of MB in a full run)
        shutil.rmtree(workdir, ignore_errors=True)
    cols = [Column("size", "model (floats)", "{:,}"), Column("payload_kb", "payload (KB)",
                                                              "{:,.0f}"),
            Column("plain_updates_s", "plain updates/s", "{:,.0f}"),
            Column("durable_updates_s", "durable updates/s", "{:,.0f}"),
            Column("ratio", "durable / plain", "{:.2f}x"),
            Column("plain_p50_ms", "plain p50 (ms)", "{:.1f}"),
            Column("durable_p50_ms", "durable p50 (ms)", "{:.1f}"),
            Column("plain_p95_ms", "plain p95 (ms)", "{:.1f}"),
            Column("durable_p95_ms", "durable p95 (ms)", "{:.1f}"),
            Column("ops_per_commit", "ops per commit", "{:.1f}"),
            Column("spool_mb_s", "durable MB/s spooled", "{:.0f}"),
            Column("disk_mb_s", "disk MB/s (fsynced)", "{:.0f}")]
    report.table(f"{CLIENTS} concurrent pushers, {pushes} pushes per run", cols, rows)
    for row in rows:
        report.target(f"durable throughput relative to plain, {row['size']:,} floats",
                      row["ratio"], ">=", 0.5, unit="x")
    small, large = rows[0], rows[-1]
    report.target(f"durable p50 push latency added, {small['size']:,} floats",
                  small["durable_p50_ms"] - small["plain_p50_ms"], "<=", 25.0, unit="ms")
    report.target(f"payload bytes spooled relative to the disk's fsynced bandwidth, "
                  f"{large['size']:,} floats", large["spool_mb_s"] / large["disk_mb_s"], ">=",
                  0.6, unit="x")
    report.note("Durable: every push is spooled and committed (counted id, pending row, "
                "counters) before its reply; one store thread groups the commits of pushes "
                "that wait at the same time. Plain: the same server without state.db (it still "
                "writes metrics and checkpoint.npz per version). Absolute figures depend on "
                "the disk's fsync latency; the machine was shared.")
    report.note(f"Ops per commit: {statistics.fmean(r['ops_per_commit'] for r in rows):.1f} "
                f"on average (group commit). Writing and fsyncing a "
                f"{4 * large['size'] / 1e6:.0f} MB payload alone takes "
                f"{1e3 * 4 * large['size'] / 1e6 / large['disk_mb_s']:.0f} ms at the disk's "
                f"{large['disk_mb_s']:.0f} MB/s, so no fixed latency target is set for large "
                f"updates; the spooled-bandwidth target says how close intake comes to the "
                f"disk. Where it falls short the limit is CPU (payload copies and thread "
                f"hand-offs on a small shared machine), not the disk.", after_tables=True)
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    sys.exit(run())
