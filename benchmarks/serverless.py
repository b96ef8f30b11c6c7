"""The serverless aggregation tier: where an update's CPU goes, and how it scales with workers.

One aggregator runs in its own process (as ``murmura server`` does); pusher processes send
pre-encoded updates as fast as it takes them, and a probe process times a Join and a GetTask
every 20 ms meanwhile. Every load runs with ``workers = 0`` (decode and fold on the gateway:
the peer) and with W = 1, 2, ... worker processes, up to as many as the machine has cores - 2.

Loads (decode-heavy, as issue 29 sets them):

* ``int8`` and ``topk`` (1 %) updates of a 10M-value model, FedAvg;
* ``seed`` updates (300 zeroth-order steps each) of a 1M-value model, replayed by the server;
* ``default``: the int8 load under the `default` robust rule, which needs every update of a
  version at once (buffers of 10; the other loads never publish: their buffer is larger than
  the load, so what is measured is taking updates in).

For each run the CPU time of the server's processes is read from /proc and split:

* **serial** — the gateway process (gRPC receive, checks, spool, acknowledgement, the event
  loop, the publisher thread): one process, its cost bounds the tier's throughput;
* **parallel** — the worker processes (decode, fold, merge): more workers, more of it at once.

``N_max = (serial + parallel) / serial`` is the most the tier could gain from workers on a
machine with enough cores (Amdahl); the targets ask for a serial share of at most 5 % of an
update's CPU (N_max >= 20) for int8, top-k and seed, 15 % for `default`. On a machine with at
least 12 cores, 12 workers must also take at least 8x the in-process path's updates/s.

Kept from the earlier tier benchmark: GetTask/Join p99 under load, idle CPU after the load
(workers stop when idle), and a 3-level hierarchy that must publish the flat run's model.

Run: ``python benchmarks/serverless.py [--quick | --smoke]``.
"""

from __future__ import annotations

import multiprocessing as mp
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
from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402

#: threads per pusher process
PUSHERS = 4
LOADS = {  # name -> (model size, codec, codec options, rule)
    "int8": (10_000_000, "int8", {}, "fedavg"),
    "topk": (10_000_000, "topk", {"ratio": "0.01"}, "fedavg"),
    "seed": (1_000_000, "seed", {}, "fedavg"),
    "default": (10_000_000, "int8", {}, "default"),
}
SEED_STEPS = 300
#: largest serial share of an update's CPU per load
SERIAL_GOALS = {"int8": 0.05, "topk": 0.05, "seed": 0.05, "default": 0.15}
#: on a machine with at least SCALE_WORKERS cores: SCALE_WORKERS workers >= SCALE_GOAL x in-process
SCALE_WORKERS, SCALE_GOAL = 12, 8.0
#: the `default` load publishes every DEFAULT_BUFFER updates (the rule keeps them all)
DEFAULT_BUFFER = 10
PROBE_PERIOD_S = 0.02
#: seconds the gateway's CPU is read with the probe running and no updates, before a load
BACKGROUND_S = 2.0
IDLE_S = 30.0
#: --smoke: the same loads, paths and processes at toy sizes (and a token idle period)
SMOKE_SIZES = {"int8": 100_000, "topk": 100_000, "seed": 10_000, "default": 100_000}
SMOKE_SEED_STEPS, SMOKE_IDLE_S = 10, 0.5


def _use_smoke_sizes() -> None:
    """Shrink the module's sizes for this process (the server and the pushers get theirs
    as arguments, so they follow)."""
    global LOADS, SEED_STEPS, IDLE_S
    LOADS = {k: (SMOKE_SIZES[k], *v[1:]) for k, v in LOADS.items()}
    SEED_STEPS, IDLE_S = SMOKE_SEED_STEPS, SMOKE_IDLE_S


def worker_counts(cores: int, *, quick: bool) -> list[int]:
    """0 (in-process), 1, 2, then doubling up to cores - 2, SCALE_WORKERS when the machine has
    that many cores, and cores - 2 itself."""
    top = max(cores - 2, 2)
    counts = {0, 2, top} if quick else {0, 1, 2, top}
    w = 4
    while w < top and not quick:
        counts.add(w)
        w *= 2
    if cores >= SCALE_WORKERS:
        counts.add(SCALE_WORKERS)
    return sorted(c for c in counts if c <= top)


# -- the server process ------------------------------------------------------------------------


def _server_main(conn: Any, size: int, config: dict[str, Any]) -> None:
    """Serve a vector model of ``size`` values; answer 'stats' and 'stop' on ``conn``."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from murmura.protocols import ModelSpec, TaskSettings, TensorSpec
    from murmura.server import AggregatorCore, ServerConfig, ServerThread

    train = TaskSettings(**config.pop("train", {}))
    # The load generator joins and pushes raw, unsigned (legacy ids; docs/security.md).
    cfg = ServerConfig.from_flat(address="127.0.0.1:0", train=train, require_identity=False,
                                 **config)
    spec = ModelSpec((TensorSpec("w", (size,)),))
    core = AggregatorCore(cfg, spec, np.zeros(size, np.float32))
    srv = ServerThread(core, "127.0.0.1:0").start()
    conn.send(srv.address)

    def _publisher_tid() -> int | None:  # the OS id of the publisher's thread, once it runs
        srv.core.publisher.drain()
        thread = srv.core.publisher._thread
        return thread.native_id if thread is not None else None
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            tier = srv.server.tier
            backend = tier.backend
            folds = core.folds
            conn.send({"tier": srv.call(tier.stats),
                       "backend": srv.call(backend.stats) if backend is not None else {},
                       "folds": srv.call(folds.stats) if folds is not None else {},
                       "updates": srv.call(lambda: core.traffic.updates),
                       "version": srv.call(lambda: core.version),
                       "publisher_tid": srv.call(_publisher_tid),
                       "receiver_pids": srv.call(lambda: srv.server.receivers.pids
                                                 if srv.server.receivers is not None else []),
                       "refused": srv.call(lambda: dict(core.traffic.refused))})
        elif cmd == "stop":
            srv.stop(grace=None)
            conn.send("stopped")
            return


class ServerProcess:
    def __init__(self, size: int, **config: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, args=(child, size, config), daemon=False)
        self.proc.start()
        deadline = time.monotonic() + 120
        while not self.conn.poll(0.2):  # fail at once if it died (its traceback is on stderr)
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.join(10)
                raise RuntimeError(f"the server process did not start (exit code "
                                   f"{self.proc.exitcode})")
        self.address: str = self.conn.recv()
        self.publisher_tid: int | None = None

    def stats(self) -> dict[str, Any]:
        self.conn.send("stats")
        return self.conn.recv()

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the gateway process itself (every thread of it), its publisher
        thread alone, everything it started (forkserver, workers and receivers, live or
        reaped), and of that its receiver processes."""
        pid = self.proc.pid
        assert pid is not None
        if self.publisher_tid is None:
            self.publisher_tid = self.stats()["publisher_tid"]
        gateway = cpu_seconds(pid)
        publisher = (cpu_seconds(pid, self.publisher_tid)
                     if self.publisher_tid is not None else 0.0)
        receivers = sum(cpu_seconds(r) for r in self.stats()["receiver_pids"])
        return {"gateway": gateway, "publisher": publisher, "receivers": receivers,
                "workers": tree_cpu_seconds(pid) - gateway}

    def stop(self) -> None:
        try:
            self.conn.send("stop")
            self.conn.poll(60) and self.conn.recv()
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


# -- load and probe ----------------------------------------------------------------------------


def make_payloads(load: str, folder: Path) -> tuple[str, list[Path]]:
    """8 distinct pre-encoded updates of ``load``, written to ``folder`` (pushers map them)."""
    import torch

    from murmura.protocols import create_codec

    size, codec, options, _ = LOADS[load]
    c = create_codec(codec, options)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(8):
        enc = c.encoder(size, seed=i)
        if codec == "seed":
            theta = torch.zeros(size)
            for _ in range(SEED_STEPS):
                enc.step(theta, seed=enc.next_seed(), g=float(rng.standard_normal()), lr=1e-3)
            data = enc.encode(np.zeros(size, np.float32))
        else:
            data = enc.encode((rng.standard_normal(size) * 1e-3).astype(np.float32))
        path = folder / f"{load}-{i}.bin"
        path.write_bytes(data)
        paths.append(path)
    return codec, paths


def _pusher_main(address: str, codec: str, paths: list[str], count: int, name: str,
                 ready: Any, go: Any, out: Any) -> None:
    """One pusher process: PUSHERS threads push ``count`` updates in all, cycling through the
    payload files; sends (first send, last answer, CPU seconds, error or None)."""
    from murmura.client import GrpcTransport, RemoteError
    from murmura.protocols import DeviceProfile, UpdateHeader

    payloads = [Path(p).read_bytes() for p in paths]
    transports = [GrpcTransport(address, timeout_s=600) for _ in range(PUSHERS)]
    joins = [t.join(f"{name}-{i}", DeviceProfile()) for i, t in enumerate(transports)]
    sessions = [result.session for result, _ in joins]
    fingerprint = joins[0][1].fingerprint()
    errors: list[str] = []

    def run(i: int) -> None:
        t, s = transports[i], sessions[i]
        for k in range(i, count, PUSHERS):
            payload = payloads[k % len(payloads)]
            header = UpdateHeader(session=s, update_id=uuid.uuid4().hex[:12], base_version=0,
                                  round=0, num_examples=10, codec=codec,
                                  payload_bytes=len(payload), spec_fingerprint=fingerprint)
            while True:
                try:
                    t.push(header, payload)
                    break
                except RemoteError as exc:  # back-pressure: wait as the server asks
                    if exc.retry_after_s is None:
                        errors.append(str(exc))
                        return
                    time.sleep(exc.retry_after_s)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(PUSHERS)]
    ready.set()
    go.wait()
    cpu0, t0 = time.process_time(), time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t1 = time.time()
    out.send((t0, t1, time.process_time() - cpu0, errors[0] if errors else None))
    for t in transports:
        t.close()


def push_load(address: str, codec: str, paths: list[Path], count: int, procs: int
              ) -> tuple[float, float]:
    """Push ``count`` updates from ``procs`` pusher processes; (seconds from the first send to
    the last answer, the pushers' CPU seconds)."""
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    shares = [count // procs + (i < count % procs) for i in range(procs)]
    running = []
    for i, share in enumerate(shares):
        ready, (rx, tx) = ctx.Event(), ctx.Pipe(duplex=False)
        p = ctx.Process(target=_pusher_main, args=(address, codec, [str(x) for x in paths],
                                                   share, f"pusher{i}", ready, go, tx))
        p.start()
        running.append((p, ready, rx))
    try:
        for _, ready, _ in running:
            if not ready.wait(180):
                raise RuntimeError("a pusher process did not start")
        go.set()
        results = [rx.recv() for _, _, rx in running]
    finally:
        for p, _, _ in running:
            p.join(60)
            if p.is_alive():
                p.kill()
    failed = [r[3] for r in results if r[3]]
    if failed:
        raise RuntimeError(f"a push was refused: {failed[0]}")
    return (max(r[1] for r in results) - min(r[0] for r in results),
            sum(r[2] for r in results))


def _probe_main(address: str, stop: Any, ready: Any, out: Any) -> None:
    from murmura.client import GrpcTransport
    from murmura.protocols import DeviceProfile

    t = GrpcTransport(address, timeout_s=60)
    t.join("probe-warm-up", DeviceProfile())  # connected before the load starts
    ready.set()
    join_ms: list[float] = []
    task_ms: list[float] = []
    i = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        session = t.join(f"probe-{i}", DeviceProfile())[0].session
        t1 = time.perf_counter()
        t.task(session, 0.0)
        t2 = time.perf_counter()
        join_ms.append(1e3 * (t1 - t0))
        task_ms.append(1e3 * (t2 - t1))
        i += 1
        stop.wait(PROBE_PERIOD_S)
    t.close()
    out.send((join_ms, task_ms))


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def pusher_procs(cores: int) -> int:
    """Pusher processes: one on a small machine, up to 4 where the tier has cores to fill."""
    return 1 if cores <= 4 else min(4, cores // 4)


def measure(load: str, workers: int, paths: list[Path], codec: str, count: int, *,
            cores: int, backend: str = "process", idle: bool = False,
            receivers: int = 0) -> dict[str, Any]:
    size, _, options, rule = LOADS[load]
    train = {"codec": codec, "codec_options": options}
    if codec == "seed":
        train["trainer"] = "zo"
    # The pushers are a load generator, not hostile clients: no per-client rate limit. A
    # FedAvg load never publishes (its buffer is larger than the load); `default` publishes
    # every DEFAULT_BUFFER updates, its rule's work included.
    buffer = DEFAULT_BUFFER if rule != "fedavg" else 10**9
    config = {"push_per_s": 0.0, "mode": "async", "min_clients": 1, "max_versions": 10**6,
              "buffer_size": buffer, "max_staleness": 10**9, "workers": workers,
              "backend": backend, "defense": rule, "max_payload_mb": 256, "train": train}
    if workers > 0:
        config["max_workers"] = workers
    if receivers:  # pushes received in their own processes (server/receivers.py)
        config["receivers"] = receivers
    server = ServerProcess(size, **config)
    ctx = mp.get_context("spawn")
    stop, ready, (rx, tx) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_probe_main, args=(server.address, stop, ready, tx))
    try:
        probe.start()
        if not ready.wait(120):
            raise RuntimeError("the probe process did not connect")
        # The gateway's CPU without updates (the probe's calls, timers, gRPC's pollers),
        # per second: subtracted from the load's, so the serial figure is the updates' own.
        quiet0, t_quiet = server.cpu(), time.monotonic()
        time.sleep(BACKGROUND_S)
        cpu0 = server.cpu()
        background = (cpu0["gateway"] - quiet0["gateway"]) / (time.monotonic() - t_quiet)
        elapsed, pushers_cpu = push_load(server.address, codec, paths, count,
                                         pusher_procs(cores))
        pushed = time.monotonic()
        stats = server.stats()
        if rule != "fedavg":  # the versions the load completed are part of its cost
            deadline = time.monotonic() + 600
            while stats["version"] < stats["updates"] // buffer and time.monotonic() < deadline:
                time.sleep(0.2)
                stats = server.stats()
        elapsed_all = elapsed + (time.monotonic() - pushed if rule != "fedavg" else 0.0)
        cpu1 = server.cpu()
        stop.set()
        join_ms, task_ms = rx.recv()
        probe.join(30)
        n = stats["updates"] or 1
        serial = max(cpu1["gateway"] - cpu0["gateway"] - background * elapsed_all, 0.0)
        parallel = cpu1["workers"] - cpu0["workers"]
        row: dict[str, Any] = {
            "load": load, "workers": workers, "receivers": receivers,
            "path": _path_name(workers, backend, receivers),
            "pushes": count, "seconds": elapsed_all, "updates_per_s": count / elapsed_all,
            "taken": stats["updates"], "versions": stats["version"],
            "join_p99_ms": p99(join_ms), "task_p99_ms": p99(task_ms), "probes": len(join_ms),
            "refused": sum(stats["refused"].values()),
            "serial_ms": 1e3 * serial / n, "parallel_ms": 1e3 * parallel / n,
            "publisher_ms": 1e3 * (cpu1["publisher"] - cpu0["publisher"]) / n,
            "receivers_ms": 1e3 * (cpu1["receivers"] - cpu0["receivers"]) / n,
            "pushers_cpu_ms": 1e3 * pushers_cpu / count,
            "worker_folds": stats["folds"].get("worker_folds", 0),
            "background_ms_per_s": 1e3 * background,
        }
        total = serial + parallel
        row["serial_share"] = serial / total if total > 0 else float("nan")
        row["n_max"] = total / serial if serial > 0 else float("inf")
        b = stats["backend"]
        row["cold_starts"] = b.get("cold_starts")
        row["cold_start_ms"] = _ms(b.get("cold_start_mean_s"))
        row["dispatch_ms"] = _ms(b.get("warm_dispatch_latency_mean_s"))
        if idle:
            c0 = tree_cpu_seconds(server.proc.pid)  # type: ignore[arg-type]
            time.sleep(IDLE_S)
            row["idle_cpu_s"] = tree_cpu_seconds(server.proc.pid) - c0  # type: ignore[arg-type]
            row["workers_left"] = server.stats()["tier"].get("workers", 0)
        return row
    finally:
        stop.set()
        if probe.is_alive():
            probe.kill()
        server.stop()


def plan(load: str, counts: list[int], receivers: int) -> list[tuple[int, int]]:
    """(workers, receivers) per row of ``load``: every worker count with ``receivers``
    receiver processes (-1: as many as workers); the int8 and top-k loads, whose receive is
    most of the gateway's work, once more at the most workers with the gateway receiving, to
    compare. `default` spends seconds per version on its rule: the two ends only."""
    top = max(counts)
    def with_receivers(w: int) -> int:
        return 0 if w == 0 else w if receivers < 0 else receivers
    rows = [(w, with_receivers(w)) for w in (counts if load != "default" else [0, top])]
    if load in ("int8", "topk") and with_receivers(top):
        rows.append((top, 0))
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _path_name(workers: int, backend: str, receivers: int = 0) -> str:
    if workers == 0:
        return "in-process (workers 0)"
    if backend == "ray":
        return "Ray, local"
    name = f"{workers} worker process{'es' if workers > 1 else ''}"
    return f"{name} + {receivers} receiver{'s' if receivers > 1 else ''}" if receivers \
        else f"{name}, gateway receives"


# -- hierarchy ---------------------------------------------------------------------------------


def hierarchy(versions: int) -> dict[str, Any]:
    """Flat vs clients -> 2 leaves -> middle -> top, exact sums; final models and timings."""
    import torch

    from murmura.client import ClientRuntime, FunctionTrainer, GrpcTransport, RetryPolicy
    from murmura.protocols.identity import NodeKey
    from murmura.server import ServerConfig, ServerThread, build_core
    from murmura.server.leaf import Leaf
    from murmura.tasks import TaskConfig, load_task

    task_cfg = TaskConfig(task="digits", model="mlp", partition="iid")
    task = load_task(task_cfg)

    def fn(index: int):  # noqa: ANN202
        def train(model: torch.nn.Module, settings: Any, seed: int) -> dict[str, float]:
            with torch.no_grad():
                for k, p in enumerate(model.parameters()):
                    p.add_(0.01 * torch.tanh(p * (index + 1)) + 1e-4 * (index - 1.5) * (k + 1))
            return {"num_examples": 10 + index}
        return train

    def clients(addresses: list[str]) -> list[threading.Thread]:
        out = []
        for i, address in enumerate(addresses):
            runtime = ClientRuntime(GrpcTransport(address, timeout_s=60),
                                    FunctionTrainer(task.build_model(), fn(i)), wait_s=2.0,
                                    retry=RetryPolicy(initial_s=0.05, give_up_after_s=120))
            th = threading.Thread(target=runtime.run, daemon=True)
            th.start()
            out.append(th)
        return out

    keys = Path(tempfile.mkdtemp(prefix="murmura-leaf-keys-"))

    def key_file(name: str) -> Path:
        """A leaf's identity key (made once) under ``keys``."""
        path = keys / f"{name}.key"
        if not path.exists():
            NodeKey.from_seed(name).save(path)
        return path

    def registry(*names: str) -> str:
        """The --leaf-keys file a parent registers the leaves ``names`` in."""
        path = keys / f"{'-'.join(names)}.txt"
        path.write_text("".join(Path(f"{key_file(n)}.pub").read_text() for n in names))
        return str(path)

    def top(min_clients: int, leaf_keys: str = "") -> Any:
        return build_core(ServerConfig.from_flat(mode="sync", min_clients=min_clients, workers=0,
                                                 max_versions=versions, accumulator="exact",
                                                 leaf_keys=leaf_keys),
                          task_cfg, out_dir=None, evaluate=False)

    def leaf(up: str, name: str, leaf_keys: str = "") -> Any:
        return Leaf(ServerConfig.from_flat(role="leaf", upstream=up, name=name, min_clients=2,
                                           workers=0, accumulator="exact", key=str(key_file(name)),
                                           leaf_keys=leaf_keys), task_cfg)

    core = top(4)
    with ServerThread(core, "127.0.0.1:0") as srv:
        t0 = time.perf_counter()
        threads = clients([srv.address] * 4)
        srv.wait_done(600)
        flat_s = time.perf_counter() - t0
        flat = srv.call(lambda: core.params.copy())
        for th in threads:  # while the server still answers: clients learn the run is over
            th.join(30)

    core = top(1, registry("middle"))
    servers = []
    try:
        servers.append(ServerThread(core, "127.0.0.1:0").start())
        servers.append(ServerThread(leaf(servers[0].address, "middle",
                                         registry("leaf-a", "leaf-b"))).start())
        for name in ("leaf-a", "leaf-b"):
            servers.append(ServerThread(leaf(servers[1].address, name)).start())
        t0 = time.perf_counter()
        threads = clients([servers[2].address] * 2 + [servers[3].address] * 2)
        servers[0].wait_done(600)
        tree_s = time.perf_counter() - t0
        tree = servers[0].call(lambda: core.params.copy())
        for th in threads:
            th.join(30)
    finally:
        for s in reversed(servers):
            s.stop(grace=None)
        shutil.rmtree(keys, ignore_errors=True)
    return {"identical": bool(np.array_equal(flat, tree)),
            "max_abs_diff": float(np.abs(flat - tree).max()),
            "flat_s_per_version": flat_s / versions, "tree_s_per_version": tree_s / versions,
            "versions": versions}


# -- the run -----------------------------------------------------------------------------------


def run(argv: list[str] | None = None) -> int:
    def extra(parser: Any) -> None:
        parser.add_argument("--workers", default="", metavar="LIST",
                            help="worker counts to measure, e.g. 0,1,2,4,8,12,14 (default: 0, "
                                 "1, 2, doubling, and cores - 2)")
        parser.add_argument("--receivers", type=int, default=-1, metavar="N",
                            help="receiver processes beside W workers (default -1: W; 0: the "
                                 "gateway receives every push)")

    args = parse_args("serverless", "Where the tier's CPU goes, and how it scales with workers",
                      argv, extra)
    quick = args.quick
    pushes = {"int8": 80, "topk": 120, "seed": 48, "default": 40} if quick else \
        {"int8": 240, "topk": 300, "seed": 96, "default": 80}
    if args.smoke:
        _use_smoke_sizes()
        pushes = dict.fromkeys(LOADS, 2 * PUSHERS)
    report = Report("serverless", quick=quick, params={})
    cores = report.machine["cpus_usable"] or report.machine["cpu_count"] or 1
    counts = (sorted({0, *(int(w) for w in args.workers.split(","))}) if args.workers
              else worker_counts(cores, quick=quick or args.smoke))
    top = max(counts)
    report.params.update({
        "pushers": f"{pusher_procs(cores)} process(es) x {PUSHERS} threads",
        "loads": {k: {"size": v[0], "codec": v[1], "options": v[2], "rule": v[3]}
                  for k, v in LOADS.items()},
        "seed_steps": SEED_STEPS, "pushes": pushes, "workers": counts,
        "probe_period_s": PROBE_PERIOD_S, "idle_s": IDLE_S, "default_buffer": DEFAULT_BUFFER})
    rows: list[dict[str, Any]] = []
    folder = Path(tempfile.mkdtemp(prefix="murmura-serverless-"))
    try:
        for load in LOADS:
            progress(f"{load}: encoding 8 updates")
            codec, paths = make_payloads(load, folder)
            # `default` spends seconds per version on its rule: the two ends only
            for workers, receivers in plan(load, counts, args.receivers):
                progress(f"{load}: {_path_name(workers, 'process', receivers)}, "
                         f"{pushes[load]} pushes")
                row = measure(load, workers, paths, codec, pushes[load], cores=cores,
                              idle=workers == top and load == "int8" and receivers > 0,
                              receivers=receivers)
                row["comparison"] = workers > 0 and not receivers and args.receivers != 0
                rows.append(row)
                progress(f"  {row['updates_per_s']:.2f} updates/s; CPU per update: serial "
                         f"{row['serial_ms']:.2f} ms, workers {row['parallel_ms']:.2f} ms "
                         f"(serial share {row['serial_share']:.1%}); GetTask p99 "
                         f"{row['task_p99_ms']:.1f} ms")
            base = next(r for r in rows if r["load"] == load and r["workers"] == 0)
            for r in rows:
                if r["load"] == load:
                    r["vs_in_process"] = r["updates_per_s"] / base["updates_per_s"]
        ray_row = None
        try:
            import ray  # noqa: F401

            progress("int8 through Ray")
            codec, paths = make_payloads("int8", folder)
            ray_row = measure("int8", 2, paths, codec, pushes["int8"], cores=cores,
                              backend="ray")
            rows.append(ray_row)
        except ImportError:
            report.note("Ray is not installed here (`pip install \"murmura[ray]\"`): no Ray "
                        "row.")
        except RuntimeError as exc:  # a local Ray start can fail on a loaded machine
            report.note(f"The Ray row failed: {exc}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    progress("hierarchy: flat vs 3 levels")
    tree = hierarchy(1 if args.smoke else 3 if quick else 10)

    cols = [Column("load", "load"), Column("path", "decoding and folding"),
            Column("pushes", "pushes"), Column("updates_per_s", "updates/s", "{:.2f}"),
            Column("vs_in_process", "÷ in-process", "{:.2f}x"),
            Column("serial_ms", "serial CPU ms/update", "{:.2f}"),
            Column("publisher_ms", "of it publisher", "{:.2f}"),
            Column("parallel_ms", "workers CPU ms/update", "{:.2f}"),
            Column("receivers_ms", "of it receivers", "{:.2f}"),
            Column("serial_share", "serial share", "{:.1%}"),
            Column("n_max", "N_max", "{:.1f}"),
            Column("pushers_cpu_ms", "pushers ms/update", "{:.2f}"),
            Column("task_p99_ms", "GetTask p99 ms", "{:.1f}"),
            Column("join_p99_ms", "Join p99 ms", "{:.1f}")]
    report.table("Throughput and where an update's CPU goes, by workers", cols, rows)
    report.table("Idle cost and the worker pool (largest worker count)", [
        Column("load", "load"), Column("path", "decoding and folding"),
        Column("idle_cpu_s", f"idle CPU s / {IDLE_S:g} s", "{:.2f}"),
        Column("workers_left", "workers left"), Column("cold_starts", "cold starts"),
        Column("cold_start_ms", "cold start ms", "{:.0f}"),
        Column("dispatch_ms", "submit → start ms", "{:.2f}")],
        [r for r in rows if "idle_cpu_s" in r])
    report.table("Hierarchy: 3 levels against flat on the same updates (exact sums)",
                 [Column("versions", "versions"), Column("identical", "identical model"),
                  Column("max_abs_diff", "max |flat - tree|", "{:.3g}"),
                  Column("flat_s_per_version", "flat s/version", "{:.3f}"),
                  Column("tree_s_per_version", "3 levels s/version", "{:.3f}")], [tree])
    widest = {load: next(r for r in rows if r["load"] == load and r["workers"] == top
                         and r["receivers"] == max(x["receivers"] for x in rows
                                                   if x["load"] == load and x["workers"] == top))
              for load in LOADS}
    for load, goal in SERIAL_GOALS.items():
        r = widest[load]
        report.target(f"{load}: serial share of an update's CPU ({r['path']})",
                      100 * r["serial_share"], "<=", 100 * goal, unit="%",
                      detail=f"serial {r['serial_ms']:.2f} ms, workers {r['parallel_ms']:.2f} "
                             f"ms per update; N_max {r['n_max']:.1f}")
    if cores >= SCALE_WORKERS:
        for load in ("int8", "topk", "seed"):
            r = max((r for r in rows if r["load"] == load and r["workers"] == SCALE_WORKERS),
                    key=lambda r: r["updates_per_s"])
            report.target(f"{load}: updates/s with {SCALE_WORKERS} workers ÷ in-process",
                          r["vs_in_process"], ">=", SCALE_GOAL, unit="x",
                          detail=f"{cores} cores")
    else:
        report.note(f"This machine has {cores} cores: the scaling target ({SCALE_WORKERS} "
                    f"workers >= {SCALE_GOAL:g}x in-process) needs at least {SCALE_WORKERS}; "
                    f"the rows are reported, not targeted.")
    tier_rows = [r for r in rows if r["workers"] == top and r["path"] != "Ray, local"]
    report.target(f"GetTask p99 under load (worst load, {top} workers)",
                  max(r["task_p99_ms"] for r in tier_rows), "<=", 50, unit="ms")
    report.target(f"Join p99 under load (worst load, {top} workers)",
                  max(r["join_p99_ms"] for r in tier_rows), "<=", 50, unit="ms")
    idle_rows = [r for r in rows if "idle_cpu_s" in r]
    report.target(f"idle CPU seconds in {IDLE_S:g} s after the load (worst load)",
                  max(r["idle_cpu_s"] for r in idle_rows), "<=", 0.3, unit="s")
    report.target("workers left after the idle period (worst load)",
                  max(r["workers_left"] for r in idle_rows), "<=", 0)
    report.target("3 levels vs flat: models identical (1 = yes)", float(tree["identical"]),
                  ">=", 1)
    report.note(
        f"One aggregator process per row, async mode; pusher processes "
        f"({pusher_procs(cores)} x {PUSHERS} threads) send pre-encoded updates as fast as it "
        f"answers, and a probe process times a Join and a GetTask every "
        f"{1e3 * PROBE_PERIOD_S:g} ms. 'in-process' decodes and folds in the gateway "
        f"(`--workers 0`); 'W worker processes' is the tier with `--workers W`, which folds "
        f"FedAvg updates in the workers (server/folds.py); '+ R receivers' adds `--receivers "
        f"R`: R processes that receive the Push streams on their own port into the tier's "
        f"shared memory and hand each update to the gateway (server/receivers.py); 'gateway "
        f"receives' is the same tier without them. CPU from /proc: serial = the "
        f"gateway process (all its threads: gRPC, event loop, publisher) less what it spends "
        f"per second with the probe alone and no updates (read for {BACKGROUND_S:g} s before "
        f"each load), workers = the processes it started (receivers included, also shown "
        f"alone); N_max = (serial + workers) / "
        f"serial. The FedAvg loads never "
        f"publish (buffer larger than the load); `default` publishes every {DEFAULT_BUFFER} "
        f"updates and its time includes those versions (it runs in-process and with the most "
        f"workers only). Idle: CPU seconds of the server's processes over {IDLE_S:g} s without "
        f"clients after the int8 run with the most workers.")
    _plot(report, rows, counts, cores)
    return report.finish(save=not args.no_save)


def _plot(report: Report, rows: list[dict[str, Any]], counts: list[int], cores: int) -> None:
    """Updates/s against workers per load (relative to in-process), and the serial share."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for load in LOADS:
        mine = sorted((r for r in rows if r["load"] == load and r["path"] != "Ray, local"
                       and not r.get("comparison")), key=lambda r: r["workers"])
        xs = [r["workers"] for r in mine]
        axes[0].plot(xs, [r["vs_in_process"] for r in mine], marker="o", label=load)
        line = axes[1].plot(xs[1:], [100 * r["serial_share"] for r in mine[1:]], marker="o",
                            label=load)[0]
        for r in rows:  # the gateway receiving, for comparison: a cross in the load's colour
            if r["load"] == load and r.get("comparison"):
                axes[1].plot([r["workers"]], [100 * r["serial_share"]], marker="x", ms=9,
                             color=line.get_color(), ls="none")
    axes[0].plot(counts, [max(c, 1) for c in counts], ls=":", color="grey", label="linear")
    if cores >= SCALE_WORKERS:
        axes[0].plot([SCALE_WORKERS], [SCALE_GOAL], marker="*", color="black", ms=10,
                     ls="none", label=f"target {SCALE_GOAL:g}x")
    axes[0].set_xlabel("worker processes (0: in-process)")
    axes[0].set_ylabel("updates/s ÷ in-process")
    axes[1].axhline(5, color="grey", ls="--", lw=0.8, label="target 5 % (15 % default)")
    axes[1].set_xlabel("worker processes (x: the gateway receives pushes itself)")
    axes[1].set_ylabel("serial share of an update's CPU (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Serverless tier: scaling with workers ({cores} cores)")
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    sys.exit(run())
