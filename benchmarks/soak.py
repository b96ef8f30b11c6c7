"""Soak test of the aggregator: 1,000 loopback clients against one ``murmura server`` for
10 minutes, watching the server's memory and descriptors and every call's outcome.

* **the server** — ``python -m murmura server`` as a child process, as an operator runs it:
  digits MLP, async mode (FedBuff, a version every :data:`BUFFER_SIZE` updates, so versions
  keep coming), a ``--max-versions`` it never reaches, identities required and durable state
  on (both defaults), ``--out`` in a temporary directory. Its address is read from the line
  it prints at start.
* **the load** — one separate process (so the server's RSS is measured alone) runs every
  client on one ``grpc.aio`` event loop, each on its own channel and TCP connection, doing
  the real protocol: Challenge and a signed Join under its own Ed25519 key, then GetTask /
  Pull / Push of a signed dense-f32 update of the model's size (small noise) with a think
  time between tasks so that all clients together send about :attr:`Size.rate` updates/s,
  and Leave at the end. Clients join spread over a ramp.
  ``RESOURCE_EXHAUSTED`` with the ``murmura-retry-after-ms`` hint is back-pressure: the
  call is retried after the hint (with jitter) and counted as *retried*; a *failed* call is
  any other non-OK status, or a retry still refused after :data:`MAX_TRIES` tries.
* **the probes** — every few seconds this process reads the server's RSS
  (``/proc/PID/status`` VmRSS), its open descriptors (``/proc/PID/fd``) and the RSS of its
  whole process tree (decoding workers included), before, during and after the load.

Targets (from the issue): RSS growth after warm-up ≤ 10 % (minute 2 to minute 10; from
25 % of the run to its end under ``--quick`` and ``--smoke``), 0 failed calls, and the
server's descriptors back within :data:`FD_SLACK` of their baseline once every client has
left. The baseline is read after a warm-up (:data:`WARMUP`: 20 clients push and leave), so
what any server keeps once it has served a client (pooled slabs, the open spool segment) is
in it.

Run: ``python benchmarks/soak.py [--quick | --smoke]`` (full: about 11 minutes; ``--quick``:
2 minutes of load, about 3 in all; ``--smoke``: 20 clients for 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402

NAME = "soak"


@dataclasses.dataclass(frozen=True)
class Size:
    clients: int
    duration_s: float  # of the load, from the first client's start to the last task
    ramp_s: float  # clients start spread over this
    rate: float  # updates/s all clients together aim at
    warmup_frac: float  # RSS growth is measured from this share of the run to its end
    sample_s: float  # period of the RSS / descriptor probe
    progress_s: float  # period of the progress lines


SIZES = {
    "full": Size(1000, 600.0, 30.0, 30.0, 0.2, 5.0, 15.0),  # warm-up: minute 2 of 10
    "quick": Size(1000, 120.0, 10.0, 30.0, 0.25, 2.0, 10.0),
    "smoke": Size(20, 10.0, 1.0, 10.0, 0.25, 0.5, 2.0),
}
RSS_GROWTH_GOAL = 0.10
#: The server's --worker-idle-s default (10 s) and a margin.
WARMUP_IDLE_S = 12.0
FD_SLACK = 5
BUFFER_SIZE = 10  # async: updates per version
MAX_VERSIONS = 10**9  # never reached: the server runs until it is stopped
MAX_TRIES = 5  # tries of one call refused with a back-pressure hint
CALL_TIMEOUT_S = 30.0
TASK_WAIT_S = 1.0  # GetTask: how long the server may hold the call
NOISE = 1e-3  # std of the update values: the model random-walks a little and stays finite
NUM_EXAMPLES = 16
SERVER_START_S = 120.0  # the server imports torch and the data set first
SETTLE_BEFORE_S = 2.0  # after the server is up, before the baseline
#: After the last Leave, how long descriptors get to come back: more than the decoding
#: workers' default idle timeout (``--worker-idle-s`` 10 s), whose pipes the server holds.
SETTLE_AFTER_S = 20.0
SETTLE_AFTER_MIN_S = 3.0
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL after this
METHODS = ("Challenge", "Join", "GetTask", "Pull", "Push", "Leave")
LISTENING = re.compile(r"listening on (\S+):(\d+)")


# -- the load generator (its own process) -----------------------------------------------------


class CallFailed(Exception):
    """A call ended in a non-OK status (after retries where the server asked for them)."""


class IncompleteStream(Exception):
    """A Pull stream ended before the payload its header announced."""


class Load:
    """Counters and latencies of every client's calls; one asyncio loop, no locks needed."""

    def __init__(self, size: Size, address: str, t_start: float, seed: int) -> None:
        self.size = size
        self.address = address
        self.t_start = t_start
        self.t_end = t_start + size.duration_s
        self.period_s = size.clients / size.rate  # one client's mean time between tasks
        self.seed = seed
        self.latency_ms: dict[str, list[float]] = {m: [] for m in METHODS}
        self.statuses: dict[str, Counter[str]] = {m: Counter() for m in METHODS}
        self.retried: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.examples: dict[str, str] = {}  # "method status" -> first message
        self.joined = self.live = self.left = self.acked = self.duplicates = 0
        self.stops = self.waits = 0
        self.max_version = 0
        self.staleness: Counter[int] = Counter()

    def _note(self, method: str, status: str, message: str) -> None:
        self.statuses[method][status] += 1
        self.examples.setdefault(f"{method} {status}", message[:200])

    async def call(self, method: str, fn: Callable[..., Awaitable[Any]], *args: Any,
                   **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)``, timed and counted; back-pressure is retried."""
        import grpc

        for attempt in range(1, MAX_TRIES + 1):
            t0 = time.perf_counter()
            try:
                out = await fn(*args, **kwargs)
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
                self._note(method, status, exc.details() or "")
                hint = retry_after_s(exc)
                if status == "RESOURCE_EXHAUSTED" and hint is not None and attempt < MAX_TRIES:
                    self.retried[method] += 1
                    await asyncio.sleep(hint * (1.0 + 0.5 * random.random())
                                        + 0.05 * random.random())
                    continue
                self.failed[method] += 1
                raise CallFailed(f"{method}: {status}") from None
            except IncompleteStream as exc:
                self._note(method, "INCOMPLETE_STREAM", str(exc))
                self.failed[method] += 1
                raise CallFailed(f"{method}: incomplete stream") from None
            self.latency_ms[method].append(1e3 * (time.perf_counter() - t0))
            self.statuses[method]["OK"] += 1
            return out
        raise AssertionError("unreachable")

    async def pause(self, seconds: float) -> None:
        """Sleep, but never past the end of the load."""
        await asyncio.sleep(max(min(seconds, self.t_end - time.monotonic()), 0.0))

    def snapshot(self) -> dict[str, Any]:
        return {"kind": "progress", "t": time.monotonic(), "joined": self.joined,
                "live": self.live, "left": self.left, "acked": self.acked,
                "retried": sum(self.retried.values()), "failed": sum(self.failed.values())}

    def summary(self) -> dict[str, Any]:
        per_method = {}
        for m in METHODS:
            lat = sorted(self.latency_ms[m])
            per_method[m] = {
                "ok": len(lat), "retried": self.retried[m], "failed": self.failed[m],
                "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                "max_ms": lat[-1] if lat else None,
                "statuses": dict(self.statuses[m])}
        return {"kind": "result", "per_method": per_method, "examples": self.examples,
                "joined": self.joined, "left": self.left, "acked": self.acked,
                "duplicates": self.duplicates, "stops": self.stops, "waits": self.waits,
                "max_version": self.max_version,
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())}}


def retry_after_s(exc: Any) -> float | None:
    """The server's back-pressure hint (trailing ``murmura-retry-after-ms``), in seconds."""
    from murmura.client.transport import RETRY_AFTER_KEY

    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            with contextlib.suppress(ValueError):
                return min(max(int(value) / 1e3, 0.0), 60.0)
    return None


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(int(-(-q * len(sorted_values) // 100)), 1)  # ceil(q/100 * n)
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def one_client(load: Load, i: int) -> None:
    """Join at its slot in the ramp, train (fake) until the end of the load, leave."""
    import grpc
    import numpy as np

    from murmura.protocols import PROTOCOL_VERSION, DeviceProfile, UpdateHeader, serde
    from murmura.protocols import murmura_pb2 as pb
    from murmura.protocols.identity import NodeKey, payload_digest
    from murmura.protocols.messages import Action

    size = load.size
    await asyncio.sleep(max(load.t_start + size.ramp_s * i / size.clients - time.monotonic(),
                            0.0))
    rng = np.random.default_rng([load.seed, i])  # distinct streams per (run, client)
    key = NodeKey.generate()
    channel = grpc.aio.insecure_channel(load.address, options=[
        ("grpc.use_local_subchannel_pool", 1),  # its own connection, not a shared one
        ("grpc.max_reconnect_backoff_ms", 5000),
    ])
    service = "/murmura.v1.Aggregator/"
    challenge = channel.unary_unary(service + "Challenge",
                                    request_serializer=pb.ChallengeRequest.SerializeToString,
                                    response_deserializer=pb.ChallengeReply.FromString)
    join = channel.unary_unary(service + "Join",
                               request_serializer=pb.JoinRequest.SerializeToString,
                               response_deserializer=pb.JoinReply.FromString)
    get_task = channel.unary_unary(service + "GetTask",
                                   request_serializer=pb.TaskRequest.SerializeToString,
                                   response_deserializer=pb.TaskReply.FromString)
    pull = channel.unary_stream(service + "Pull",
                                request_serializer=pb.PullRequest.SerializeToString,
                                response_deserializer=serde.deserialize_model_item)
    push = channel.stream_unary(service + "Push",
                                request_serializer=serde.serialize_update_item,
                                response_deserializer=pb.PushReply.FromString)
    leave = channel.unary_unary(service + "Leave",
                                request_serializer=pb.LeaveRequest.SerializeToString,
                                response_deserializer=pb.LeaveReply.FromString)

    async def pull_version(session: str) -> int:
        header, received = None, 0
        async for item in pull(pb.PullRequest(session=session), timeout=CALL_TIMEOUT_S):
            if isinstance(item, memoryview):
                received += len(item)
            elif item.WhichOneof("kind") == "header":
                header = item.header
            else:
                received += len(item.data)
        if header is None or received != header.payload_bytes:
            raise IncompleteStream(f"{received} bytes of "
                                   f"{None if header is None else header.payload_bytes}")
        return int(header.version)

    async def push_update(header: Any, payload: bytes) -> Any:
        return await push(serde.iter_update_items(header, payload), timeout=CALL_TIMEOUT_S)

    try:
        try:
            nonce = (await load.call("Challenge", challenge, pb.ChallengeRequest(),
                                     timeout=CALL_TIMEOUT_S, wait_for_ready=True)).nonce
            proof = key.join_proof(nonce)
            request = pb.JoinRequest(client_id=key.client_id,
                                     profile=serde.profile_to_proto(DeviceProfile()),
                                     protocol_version=PROTOCOL_VERSION,
                                     public_key=proof.public_key, nonce=proof.nonce,
                                     signature=proof.signature)
            reply = await load.call("Join", join, request, timeout=CALL_TIMEOUT_S,
                                    wait_for_ready=True)
        except CallFailed:
            return
        joined, spec = serde.join_result_from_proto(reply)
        session, fingerprint, n = joined.session, spec.fingerprint(), spec.size
        load.joined += 1
        load.live += 1
        try:
            await load.pause(rng.uniform(0.0, load.period_s))  # spread the first tasks
            updates = 0
            while time.monotonic() < load.t_end:
                try:
                    task = serde.task_from_proto(await load.call(
                        "GetTask", get_task, pb.TaskRequest(session=session, wait_s=TASK_WAIT_S),
                        timeout=TASK_WAIT_S + CALL_TIMEOUT_S))
                    if task.action == Action.STOP:
                        load.stops += 1
                        break
                    if task.action == Action.WAIT:
                        load.waits += 1
                        await load.pause(max(task.retry_after_s, 0.2))
                        continue
                    version = await load.call("Pull", pull_version, session)
                    load.max_version = max(load.max_version, version)
                    values = rng.standard_normal(n, dtype=np.float32) * np.float32(NOISE)
                    payload = values.astype("<f4").tobytes()
                    header = UpdateHeader(session=session, update_id=f"c{i}-u{updates}",
                                          base_version=version, round=task.round,
                                          num_examples=NUM_EXAMPLES, codec="dense-f32",
                                          payload_bytes=len(payload),
                                          spec_fingerprint=fingerprint)
                    header = key.sign_update(header, payload_digest(payload))
                    result = await load.call("Push", push_update, header, payload)
                    updates += 1
                    load.acked += 1
                    load.duplicates += int(result.duplicate)
                    load.staleness[int(result.staleness)] += 1
                except CallFailed:
                    pass
                await load.pause(load.period_s * rng.uniform(0.5, 1.5))
        finally:
            with contextlib.suppress(CallFailed):
                await load.call("Leave", leave, pb.LeaveRequest(session=session,
                                                                reason="soak over"),
                                timeout=CALL_TIMEOUT_S)
            load.live -= 1
            load.left += 1
    finally:
        await channel.close()


async def _drive(address: str, size: Size, seed: int, out: Any) -> None:
    t_start = time.monotonic()
    load = Load(size, address, t_start, seed)
    out.put({"kind": "started", "t": t_start})
    clients = [asyncio.ensure_future(one_client(load, i)) for i in range(size.clients)]

    async def report() -> None:
        while True:
            out.put(load.snapshot())
            await asyncio.sleep(1.0)

    reporter = asyncio.ensure_future(report())
    # Each client stops starting tasks at t_end; a call takes at most MAX_TRIES deadlines.
    bound = size.duration_s + 2 * MAX_TRIES * (CALL_TIMEOUT_S + TASK_WAIT_S) + 60.0
    done, pending = await asyncio.wait(clients, timeout=bound)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=10.0)
    reporter.cancel()
    result = load.summary()
    result["t_all_left"] = time.monotonic()
    result["t_start"], result["t_end"] = t_start, load.t_end
    result["hung_clients"] = len(pending)
    result["client_errors"] = [repr(t.exception())[:300] for t in done
                               if not t.cancelled() and t.exception() is not None][:5]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    out.put(load.snapshot())
    out.put(result)


def _loadgen_main(address: str, size: Size, seed: int, out: Any) -> None:
    """Entry point of the load process: every client on one event loop."""
    raise_fd_limit()
    try:
        asyncio.run(_drive(address, size, seed, out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        out.put({"kind": "error", "text": traceback.format_exc()[-3000:]})


def raise_fd_limit() -> None:
    """Soft descriptor limit up to the hard one: 1,000 connections need more than 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the server process and its probe -------------------------------------------------------


class ServerProcess:
    """``python -m murmura server`` in a child process; always stopped by :meth:`stop`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.out = workdir / "server-out"
        self.stdout_path = workdir / "server.stdout"
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.exit_code: int | None = None
        self.killed = False
        self.stop_s: float | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "murmura", "server", "-q",
                "--address", "127.0.0.1:0", "--mode", "async",
                "--buffer-size", str(BUFFER_SIZE), "--max-versions", str(MAX_VERSIONS),
                "--out", str(self.out), "--seed", "0"]

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.stdout_path, "wb") as stdout, open(self.log_path, "wb") as stderr:
            self.proc = subprocess.Popen(self.command(), stdout=stdout, stderr=stderr,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            match = LISTENING.search(self.stdout_path.read_text(errors="replace"))
            if match:
                host, port = match.group(1), int(match.group(2))
                if host != "127.0.0.1":
                    raise RuntimeError(f"the server listens on {host}, not loopback")
                self.address = f"{host}:{port}"
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before "
                                   f"listening:\n{self.log_tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"the server did not listen within {SERVER_START_S:g} s:\n"
                           f"{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL after :data:`STOP_GRACE_S`; the
        process group too, so no decoding worker outlives the run."""
        if self.proc is None:
            return
        t0 = time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.stop_s = time.monotonic() - t0
        self.exit_code = self.proc.returncode
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray workers, if any are left

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def log_findings(self) -> dict[str, Any]:
        """Warning, error and traceback lines of the server's log."""
        text = ""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
        lines = text.splitlines()
        flagged = [ln for ln in lines if re.search(r"WARNING|ERROR|CRITICAL|Traceback", ln)]
        return {"log_lines": len(lines), "flagged_lines": len(flagged),
                "tracebacks": sum("Traceback" in ln for ln in lines),
                "first_flagged": [ln[:300] for ln in flagged[:8]]}

    def summary(self) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.out / "summary.json").read_text())
        return None


def _status_kb(pid: int, key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _cpu_s(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (decoding workers, the forkserver)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def probe(pid: int) -> dict[str, Any]:
    """One reading of the server: RSS, descriptors, threads, CPU, and its tree's RSS."""
    rss = _status_kb(pid, "VmRSS")
    fds = None
    with contextlib.suppress(OSError):
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    kids = descendants(pid)
    tree_kb = (rss or 0) + sum(_status_kb(k, "VmRSS") or 0 for k in kids)
    return {"mono": time.monotonic(), "rss_mb": None if rss is None else rss / 1024,
            "tree_rss_mb": tree_kb / 1024, "fds": fds, "threads": _status_kb(pid, "Threads"),
            "children": len(kids), "cpu_s": _cpu_s(pid)}


def fd_kinds(pid: int, workdir: Path) -> dict[str, int]:
    """The server's open descriptors by what they point at: ``socket``, ``pipe``, an anonymous
    inode's kind, or a file path (the temporary directory shown as ``TMP``)."""
    kinds: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                target = re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", target)
                kinds[target.replace(str(workdir), "TMP")] += 1
    return dict(sorted(kinds.items()))


class Sampler(threading.Thread):
    """Probes the server every ``period`` seconds until stopped (and on demand)."""

    def __init__(self, pid: int, period: float) -> None:
        super().__init__(daemon=True, name="soak-probe")
        self.pid = pid
        self.period = period
        self.samples: list[dict[str, Any]] = []
        self.clients = 0  # the load's live clients, set by the main thread
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def sample(self) -> dict[str, Any]:
        s = probe(self.pid)
        s["clients"] = self.clients
        with self._lock:
            self.samples.append(s)
        return s

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)

    def latest(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.samples[-1]) if self.samples else {}


# -- the run ----------------------------------------------------------------------------------


def soak(size: Size, seed: int, keep: bool) -> dict[str, Any]:
    """Start the server, probe it, run the load, wait for descriptors, stop the server."""
    raise_fd_limit()  # the server child inherits it: it holds one socket per client
    workdir = Path(tempfile.mkdtemp(prefix="murmura-soak-"))
    server = ServerProcess(workdir)
    sampler: Sampler | None = None
    worker: Any = None
    out: dict[str, Any] = {"workdir": str(workdir) if keep else None}
    try:
        progress(f"starting the server ({' '.join(server.command()[1:])})")
        server.start()
        progress(f"server pid {server.pid} listening on {server.address}")
        sampler = Sampler(server.pid, size.sample_s)
        sampler.start()
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's state
        _warm_up(ctx, server.address, seed)
        time.sleep(SETTLE_BEFORE_S)
        base = sampler.sample()
        out["baseline"] = base
        out["fds_baseline"] = fd_kinds(server.pid, workdir)
        progress(f"baseline after a warm-up of {WARMUP.clients} clients: RSS "
                 f"{base['rss_mb']:.1f} MB, {base['fds']} descriptors")

        messages = ctx.Queue()
        worker = ctx.Process(target=_loadgen_main, name="soak-load",
                             args=(server.address, size, seed, messages), daemon=True)
        worker.start()
        bound = (time.monotonic() + size.duration_s + 60.0
                 + 2 * MAX_TRIES * (CALL_TIMEOUT_S + TASK_WAIT_S) + 60.0)
        result: dict[str, Any] | None = None
        last: dict[str, Any] = {}
        next_line = time.monotonic() + size.progress_s
        t_start: float | None = None
        while result is None and time.monotonic() < bound:
            try:
                msg = messages.get(timeout=0.5)
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg["kind"] == "started":
                    t_start = msg["t"]
                    progress(f"load started: {size.clients} clients joining over "
                             f"{size.ramp_s:g} s, ~{size.rate:g} updates/s in all, for "
                             f"{size.duration_s:g} s")
                elif msg["kind"] == "progress":
                    last = msg
                    sampler.clients = msg["live"]
                elif msg["kind"] in ("result", "error"):
                    result = msg
            if not server.alive():
                out["server_died"] = server.proc.returncode if server.proc else None
                progress(f"the server exited ({out['server_died']}) during the load")
                break
            if not worker.is_alive() and result is None and messages.empty():
                result = {"kind": "error", "text": f"the load process exited with "
                                                   f"{worker.exitcode} without a result"}
            if time.monotonic() >= next_line and t_start is not None:
                next_line += size.progress_s
                s = sampler.latest()
                progress(f"t={time.monotonic() - t_start:5.0f}s clients {last.get('live', 0)}"
                         f"/{size.clients} (joined {last.get('joined', 0)}), updates acked "
                         f"{last.get('acked', 0)}, retried {last.get('retried', 0)}, failed "
                         f"{last.get('failed', 0)}; server RSS {s.get('rss_mb', 0):.1f} MB, "
                         f"{s.get('fds')} fds, tree RSS {s.get('tree_rss_mb', 0):.1f} MB")
        if result is None:
            result = {"kind": "error", "text": "no result from the load process in time"}
        out["load"] = result
        out["last_progress"] = last
        worker.join(30)
        if worker.is_alive():
            worker.terminate()
            worker.join(10)
        if worker.is_alive():
            worker.kill()
            worker.join(10)
        sampler.clients = 0
        t_left = result.get("t_all_left", time.monotonic())
        progress("every client has left; waiting for the server's descriptors to settle")
        settle_end = t_left + SETTLE_AFTER_S
        after = sampler.sample()
        while time.monotonic() < settle_end and server.alive():
            if (time.monotonic() - t_left >= SETTLE_AFTER_MIN_S and after["fds"] is not None
                    and after["fds"] <= base["fds"] + FD_SLACK):
                break
            time.sleep(1.0)
            after = sampler.sample()
        out["after"] = after
        out["fds_after"] = fd_kinds(server.pid, workdir)
        out["after_s"] = after["mono"] - t_left
        progress(f"after leave (+{out['after_s']:.1f} s): RSS {after['rss_mb']:.1f} MB, "
                 f"{after['fds']} descriptors (baseline {base['fds']})")
    finally:
        if worker is not None and worker.is_alive():
            worker.kill()
            worker.join(10)
        if sampler is not None:
            sampler.stop()
        server.stop()
        out["server_exit"] = server.exit_code
        out["server_killed"] = server.killed
        out["server_stop_s"] = server.stop_s
        out["server_log"] = server.log_findings()
        out["server_summary"] = server.summary()
        out["server_stdout_tail"] = server.stdout_path.read_text(errors="replace")[-500:] \
            if server.stdout_path.exists() else ""
        if not keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    out["samples"] = sampler.samples if sampler is not None else []
    return out


#: A few clients push through the server before the baseline is read, so that what the server
#: keeps once it has served anyone (its pooled receive slabs, the open spool segment, decoding
#: workers started and stopped again) is part of the baseline and not counted as a leak.
WARMUP = Size(20, 5.0, 1.0, 10.0, 0.25, 0.5, 2.0)


def _warm_up(ctx: Any, address: str, seed: int) -> None:
    messages = ctx.Queue()
    proc = ctx.Process(target=_loadgen_main, name="soak-warm-up",
                       args=(address, WARMUP, seed + 1, messages), daemon=True)
    proc.start()
    deadline = time.monotonic() + WARMUP.duration_s + 120.0
    while time.monotonic() < deadline and proc.is_alive():
        with contextlib.suppress(queue.Empty):
            if messages.get(timeout=0.5)["kind"] in ("result", "error"):
                break
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    progress(f"warm-up done; waiting {WARMUP_IDLE_S:g} s for idle decoding workers to stop")
    time.sleep(WARMUP_IDLE_S)


def _nearest(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    return min(samples, key=lambda s: abs(s["t"] - t))


def _slope_mb_per_min(samples: list[dict[str, Any]]) -> float | None:
    """Least-squares slope of RSS over the samples, in MB per minute."""
    if len(samples) < 3:
        return None
    ts = [s["t"] for s in samples]
    ys = [s["rss_mb"] for s in samples]
    t_mean, y_mean = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - t_mean) ** 2 for t in ts)
    if den == 0:
        return None
    return 60.0 * sum((t - t_mean) * (y - y_mean) for t, y in zip(ts, ys, strict=True)) / den


def _ms(v: float | None) -> float | None:
    return None if v is None else float(v)


def run(argv: list[str] | None = None) -> int:
    def extra(p: Any) -> None:
        p.add_argument("--clients", type=int, default=None, help="clients (default: by size)")
        p.add_argument("--duration-s", type=float, default=None,
                       help="seconds of load (default: 600, --quick 120, --smoke 10)")
        p.add_argument("--rate", type=float, default=None,
                       help="updates/s all clients together aim at (default: 30)")
        p.add_argument("--seed", type=int, default=0, help="seed of the clients' noise")
        p.add_argument("--keep", action="store_true",
                       help="keep the server's temporary directory (log, state) and name it")

    args = parse_args(NAME, "Soak test: many loopback clients against one aggregator "
                            "for minutes; RSS, descriptors, latencies, errors", argv, extra)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    size = SIZES[mode]
    size = dataclasses.replace(
        size, clients=args.clients or size.clients,
        duration_s=args.duration_s or size.duration_s, rate=args.rate or size.rate)
    if size.clients < 1 or size.duration_s <= 0 or size.rate <= 0:
        raise SystemExit("--clients, --duration-s and --rate must be positive")
    report = Report(NAME, quick=args.quick, params={
        "mode": mode, **dataclasses.asdict(size), "buffer_size": BUFFER_SIZE,
        "max_tries": MAX_TRIES, "call_timeout_s": CALL_TIMEOUT_S, "task_wait_s": TASK_WAIT_S,
        "noise_std": NOISE, "fd_slack": FD_SLACK, "settle_after_s": SETTLE_AFTER_S,
        "server": "python -m murmura server -q --address 127.0.0.1:0 --mode async "
                  f"--buffer-size {BUFFER_SIZE} --max-versions {MAX_VERSIONS} --out TMP "
                  "--seed 0 (task digits, model mlp, identities required, durable state, "
                  "autoscaled decoding workers: the defaults)",
        "cores": report_cores()})
    progress(f"{mode} soak: {size.clients} clients for {size.duration_s:g} s")
    out = soak(size, args.seed, args.keep)
    load = out.get("load", {})
    samples = out["samples"]
    t_start = load.get("t_start")
    if t_start is None:  # the load never started: time from the first sample
        t_start = samples[0]["mono"] if samples else time.monotonic()
    for s in samples:
        s["t"] = round(s["mono"] - t_start, 2)
    t_end = load.get("t_end", t_start + size.duration_s)
    t_warm = t_start + size.warmup_frac * size.duration_s
    during = [s for s in samples if t_start <= s["mono"] <= t_end and s["rss_mb"] is not None]
    window = [s for s in during if s["mono"] >= t_warm]
    growth = float("nan")
    rss_warm = rss_end = None
    if window:
        warm_sample = _nearest(during, t_warm - t_start)
        end_sample = during[-1]
        rss_warm, rss_end = warm_sample["rss_mb"], end_sample["rss_mb"]
        growth = (rss_end - rss_warm) / rss_warm
    base, after = out.get("baseline"), out.get("after")

    # -- tables
    per_method = load.get("per_method", {})
    rows = []
    for m in METHODS:
        r = per_method.get(m)
        if r is None:
            continue
        rows.append({"method": m, "ok": r["ok"], "retried": r["retried"], "failed": r["failed"],
                     "p50_ms": _ms(r["p50_ms"]), "p99_ms": _ms(r["p99_ms"]),
                     "max_ms": _ms(r["max_ms"])})
    if not rows:
        rows.append({"method": "(no result from the load)"})
    report.table("Calls per RPC (latency of successful calls)", [
        Column("method", "RPC"), Column("ok", "OK"),
        Column("retried", "retried (back-pressure)"), Column("failed", "failed"),
        Column("p50_ms", "p50 ms", "{:.1f}"), Column("p99_ms", "p99 ms", "{:.1f}"),
        Column("max_ms", "max ms", "{:.0f}")], rows)
    examples = load.get("examples", {})
    status_rows = [{"method": m, "status": st, "count": n,
                    "message": "" if st == "OK" else examples.get(f"{m} {st}", "")}
                   for m in METHODS for st, n in
                   sorted(per_method.get(m, {}).get("statuses", {}).items())]
    if not status_rows:
        status_rows.append({"method": "(none)", "status": "–", "count": 0, "message": ""})
    report.table("Calls by status (every attempt)", [
        Column("method", "RPC"), Column("status", "status"), Column("count", "count"),
        Column("message", "first message")], status_rows)

    phase_rows = []

    def phase(name: str, s: dict[str, Any] | None) -> None:
        if s is not None:
            phase_rows.append({"phase": name, "t": s["t"], "clients": s.get("clients"),
                               "rss_mb": s["rss_mb"], "tree_rss_mb": s["tree_rss_mb"],
                               "fds": s["fds"], "threads": s["threads"],
                               "children": s["children"]})

    phase("baseline: before any client", base)
    if window:
        phase(f"warm-up end ({size.warmup_frac:.0%} of the run)", warm_sample)
        phase("end of the load (before Leave)", end_sample)
    if during:
        phase("peak RSS during the load", max(during, key=lambda s: s["rss_mb"]))
        phase("most descriptors during the load", max(during, key=lambda s: s["fds"] or 0))
    phase(f"after every client left (+{out.get('after_s', 0):.0f} s)", after)
    report.table("Server process: RSS and descriptors", [
        Column("phase", "when"), Column("t", "t s", "{:.0f}"), Column("clients", "clients"),
        Column("rss_mb", "RSS MB", "{:.1f}"),
        Column("tree_rss_mb", "tree RSS MB (+ workers)", "{:.1f}"),
        Column("fds", "descriptors"), Column("threads", "threads"),
        Column("children", "child processes")], phase_rows or [{"phase": "(no samples)"}])
    step = max(len(samples) // 12, 1)
    series_cols = [Column("t", "t s", "{:.0f}"), Column("clients", "clients"),
                   Column("rss_mb", "RSS MB", "{:.1f}"),
                   Column("tree_rss_mb", "tree RSS MB", "{:.1f}"), Column("fds", "descriptors"),
                   Column("cpu_s", "server CPU s", "{:.1f}")]
    series = [{k: s.get(k) for k in ("t", "clients", "rss_mb", "tree_rss_mb", "fds", "threads",
                                     "children", "cpu_s")} for s in samples]
    shown = series[::step] + ([series[-1]] if series and (len(series) - 1) % step else [])
    report.table(f"Over time (every {step}th sample of {len(series)}; all in the JSON)"
                 if step > 1 else "Over time", series_cols, shown or [{"t": 0}])
    report.rows += [{"table": "time series (JSON only)", **s} for s in series]

    # -- targets
    failed = (float(sum(r["failed"] for r in per_method.values()))
              if per_method and load.get("kind") == "result" else float("nan"))
    report.target("rss_growth_after_warmup", growth, "<=", RSS_GROWTH_GOAL,
                  detail=(f"server RSS {rss_warm:.1f} MB at {size.warmup_frac:.0%} of the run "
                          f"-> {rss_end:.1f} MB at its end" if rss_warm is not None
                          else "not measured"))
    report.target("failed_calls", failed, "<=", 0,
                  detail="non-OK statuses, back-pressure retries that still failed")
    fd_delta = (float(after["fds"] - base["fds"])
                if base and after and base["fds"] is not None and after["fds"] is not None
                else float("nan"))
    report.target("fds_back_to_baseline", fd_delta, "<=", FD_SLACK,
                  detail=(f"descriptors after every client left minus before any joined: "
                          f"{after['fds']} - {base['fds']}, {out.get('after_s', 0):.0f} s after "
                          f"the last Leave" if base and after else "not measured"))

    # -- notes
    elapsed = (load.get("t_all_left", t_end) - t_start) if load else 0.0
    acked = load.get("acked", 0)
    srv_cpu = [s["cpu_s"] for s in during if s.get("cpu_s") is not None]
    cpu_text = ""
    if len(srv_cpu) > 1:
        used = srv_cpu[-1] - srv_cpu[0]
        span = max(during[-1]["mono"] - during[0]["mono"], 1e-9)
        cpu_text = (f"; the server process used {used:.0f} CPU-s over the load "
                    f"({used / span:.0%} of a core)")
    summary = out.get("server_summary") or {}
    slope = _slope_mb_per_min(window)
    report.note(
        f"Mode {mode}: {size.clients} clients, each on its own gRPC channel and connection, "
        f"from one load process (`grpc.aio`), joining over {size.ramp_s:g} s and running "
        f"GetTask / Pull / signed Push (dense-f32, the digits MLP's size) with a think time "
        f"that aims at {size.rate:g} updates/s in all, for {size.duration_s:g} s, then Leave. "
        f"The server is `python -m murmura server` (async, buffer {BUFFER_SIZE}, identities "
        f"required, durable state, default decoding workers) in its own process; its RSS "
        f"(VmRSS), descriptors (/proc/PID/fd) and the RSS of its process tree (decoding "
        f"workers) are read every {size.sample_s:g} s. RSS growth compares the sample nearest "
        f"{size.warmup_frac:.0%} of the run with the last one before the clients leave; "
        f"descriptors after the run are read once they are within {FD_SLACK} of the baseline "
        f"({SETTLE_AFTER_MIN_S:g} s after the last Leave at the earliest) or at "
        f"{SETTLE_AFTER_S:g} s, whichever comes first (idle decoding workers stop after 10 s, "
        f"and the server holds their pipes). Back-pressure (`RESOURCE_EXHAUSTED` with "
        f"`murmura-retry-after-ms`) is retried after the hint, up to {MAX_TRIES} tries.")
    report.note(
        f"Load: {load.get('joined', 0)} joined, {acked} updates acknowledged in "
        f"{elapsed:.0f} s ({acked / max(elapsed, 1e-9):.1f}/s), "
        f"{load.get('duplicates', 0)} duplicates, {load.get('waits', 0)} WAIT and "
        f"{load.get('stops', 0)} STOP answers, highest version pulled "
        f"{load.get('max_version', 0)}; push staleness counts {load.get('staleness', {})}; "
        f"the load process used {load.get('cpu_s', 0):.0f} CPU-s{cpu_text}. "
        + (f"RSS slope after warm-up (least squares): {slope:+.2f} MB/min. "
           if slope is not None else "")
        + f"The server stopped on SIGTERM in {out.get('server_stop_s') or 0:.1f} s with exit "
          f"code {out.get('server_exit')}"
        + (" (killed after the grace period)" if out.get("server_killed") else "")
        + (f", at version {summary.get('versions')}" if summary.get("versions") is not None
           else "") + ".", after_tables=True)
    before_kinds, after_kinds = out.get("fds_baseline", {}), out.get("fds_after", {})
    diff = {k: after_kinds.get(k, 0) - before_kinds.get(k, 0)
            for k in sorted(set(before_kinds) | set(after_kinds))
            if after_kinds.get(k, 0) != before_kinds.get(k, 0)}
    report.rows.append({"table": "descriptors by target (JSON only)",
                        "baseline": before_kinds, "after": after_kinds})
    if diff:
        report.note("Descriptors after the run minus the baseline, by target: "
                    + ", ".join(f"`{k}` {v:+d}" for k, v in diff.items()) + ".",
                    after_tables=True)
    log = out.get("server_log", {})
    if log.get("flagged_lines"):
        report.note(f"The server's log has {log['flagged_lines']} warning/error lines "
                    f"({log['tracebacks']} tracebacks) of {log['log_lines']}; first: "
                    + " | ".join(f"`{ln}`" for ln in log["first_flagged"]), after_tables=True)
    else:
        report.note(f"The server's log ({log.get('log_lines', 0)} lines, `-q`) has no warning, "
                    f"error or traceback.", after_tables=True)
    if load.get("kind") == "error":
        report.note(f"The load process failed: {load.get('text', '')[-1500:]}",
                    after_tables=True)
    if load.get("hung_clients"):
        report.note(f"{load['hung_clients']} clients were still running at the bound and "
                    f"were cancelled.", after_tables=True)
    if load.get("client_errors"):
        report.note("Client coroutines raised: " + "; ".join(load["client_errors"]),
                    after_tables=True)
    if out.get("server_died") is not None:
        report.note(f"The server exited during the load with code {out['server_died']}.",
                    after_tables=True)
    if out.get("workdir"):
        progress(f"kept the server's directory: {out['workdir']}")
    _plot(report, samples, t_warm - t_start, t_end - t_start,
          (load.get("t_all_left", t_end) - t_start), base)
    return report.finish(save=not args.no_save)


def report_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def _plot(report: Report, samples: list[dict[str, Any]], t_warm: float, t_end: float,
          t_left: float, base: dict[str, Any] | None) -> None:
    """Server RSS (process and tree) and descriptors over time, with the phases marked."""
    if not samples:
        return
    plt = pyplot()
    fig, (ax_rss, ax_fd) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ts = [s["t"] for s in samples]
    ax_rss.plot(ts, [s["rss_mb"] for s in samples], label="server process RSS")
    ax_rss.plot(ts, [s["tree_rss_mb"] for s in samples], label="server + workers RSS",
                alpha=0.6)
    ax_rss.set_ylabel("MB")
    ax_fd.plot(ts, [s["fds"] for s in samples], color="C2", label="server descriptors")
    if base is not None and base.get("fds") is not None:
        ax_fd.axhline(base["fds"] + FD_SLACK, color="grey", ls="--", lw=0.8,
                      label=f"baseline + {FD_SLACK}")
    ax_fd.set_ylabel("open descriptors")
    ax_fd.set_xlabel("seconds since the load started")
    ax_cl = ax_fd.twinx()
    ax_cl.plot(ts, [s["clients"] for s in samples], color="C3", alpha=0.4, lw=0.8,
               label="clients connected")
    ax_cl.set_ylabel("clients", color="C3")
    for ax in (ax_rss, ax_fd):
        for x, what in ((0.0, "load start"), (t_warm, "warm-up end"), (t_end, "load end"),
                        (t_left, "all left")):
            ax.axvline(x, color="black", ls=":", lw=0.7)
            if ax is ax_rss:
                ax.text(x, 1.0, what, transform=ax.get_xaxis_transform(), fontsize=7,
                        rotation=90, va="top", ha="right")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ax_cl.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Soak: {report.params['clients']} loopback clients, "
                 f"{report.params['duration_s']:g} s ({report.params['mode']})")
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    sys.exit(run())
