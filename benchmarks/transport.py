"""Update upload (and model download) through the real aggregator over loopback gRPC, against
raw gRPC streaming of the same bytes.

* **murmura push** — ``GrpcTransport.push(header, payload)`` of one dense-f32 update of P
  float32 values to an ``AggregatorCore`` served by ``ServerThread`` (async mode with a buffer
  larger than the run, so every push is received, validated, decoded and folded into the
  aggregate, and no version is published while timing);
* **raw push** — client streaming of the same bytes, in the same chunk size, to a minimal
  ``grpc.aio`` handler (identity serialisers) that only counts them;
* **murmura pull** — ``GrpcTransport.pull(session)``: the server streams the global model, the
  client reassembles it into a vector;
* **raw pull** — server streaming of the same bytes in the same chunks to a client that counts
  them.

Both servers run on their own event loop in a background thread of this process, with the same
message-size options, and are timed interleaved; MB/s = payload bytes / 10^6 / best seconds.
A breakdown times the pieces of a push on their own (client-side chunking, the core's
validate/decode/aggregate step without gRPC).

Run: ``python benchmarks/transport.py [--quick | --smoke]``.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import (  # noqa: E402
    Column,
    Report,
    interleaved,
    parse_args,
    progress,
    pyplot,
    time_once,
)
from murmura.client import GrpcTransport  # noqa: E402
from murmura.protocols import (  # noqa: E402
    DeviceProfile,
    ModelSpec,
    TensorSpec,
    UpdateHeader,
    serde,  # noqa: E402
)
from murmura.server import AggregatorCore, ServerConfig, ServerThread  # noqa: E402
from murmura.server.buffers import BufferPool, ReceiveBuffer  # noqa: E402
from murmura.server.service import MAX_MESSAGE_BYTES  # noqa: E402

NAME = "transport"
FULL_PARAMS, QUICK_PARAMS = 25_000_000, 5_000_000   # 100 MB and 20 MB of float32
FULL_REPEATS, QUICK_REPEATS = 9, 7
SMOKE_PARAMS, SMOKE_REPEATS = 600_000, 2  # 2.4 MB: still three 1 MiB chunks
CHUNK = serde.CHUNK_BYTES
RAW_SERVICE = "murmura.bench.Raw"
TIMEOUT_S = 300.0

PUSH, RAW_PUSH, PULL, RAW_PULL = "murmura push", "raw push", "murmura pull", "raw pull"


# -- the raw peer ----------------------------------------------------------------------------


class RawServer:
    """A bare grpc.aio server: ``Push`` counts the streamed bytes, ``Pull`` streams a buffer."""

    def __init__(self, payload: bytes, chunk_bytes: int = CHUNK) -> None:
        self.payload = memoryview(payload)
        self.chunk_bytes = chunk_bytes
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="raw-grpc")
        self._server: grpc.aio.Server | None = None

    async def _push(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        n = 0
        async for chunk in requests:
            n += len(chunk)
        return n.to_bytes(8, "little")

    async def _pull(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        view = self.payload
        for start in range(0, len(view), self.chunk_bytes):
            yield bytes(view[start:start + self.chunk_bytes])

    async def _start(self) -> None:
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        handlers = {  # no (de)serialisers: the handlers see the raw message bytes
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "Pull": grpc.unary_stream_rpc_method_handler(self._pull),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(RAW_SERVICE, handlers),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        if self.port == 0:
            raise OSError("could not bind 127.0.0.1:0")
        await server.start()
        self._server = server

    def start(self) -> RawServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


class RawClient:
    def __init__(self, port: int, chunk_bytes: int = CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 4 * chunk_bytes + (1 << 16)),
            ("grpc.max_send_message_length", 4 * chunk_bytes + (1 << 16)),
        ])
        grpc.channel_ready_future(self._channel).result(timeout=10)
        self._push = self._channel.stream_unary(f"/{RAW_SERVICE}/Push")
        self._pull = self._channel.unary_stream(f"/{RAW_SERVICE}/Pull")

    def push(self, payload: bytes) -> int:
        view = memoryview(payload)

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(view), self.chunk_bytes):
                yield bytes(view[start:start + self.chunk_bytes])

        return int.from_bytes(self._push(chunks(), timeout=TIMEOUT_S), "little")

    def pull(self) -> int:
        return sum(len(c) for c in self._pull(b"", timeout=TIMEOUT_S))

    def close(self) -> None:
        self._channel.close()


# -- the aggregator --------------------------------------------------------------------------


def make_core(p: int) -> AggregatorCore:
    spec = ModelSpec((TensorSpec("weights", (p,)),))
    config = ServerConfig.from_flat(
        mode="async", buffer_size=10**6, max_versions=10**6, max_payload_mb=512,
        max_staleness=10**6,
        push_per_s=0.0,  # one client pushing back to back: no rate limit
        require_identity=False)  # raw unsigned pushes (docs/security.md)
    initial = np.random.default_rng(1).standard_normal(p, dtype=np.float32)
    return AggregatorCore(config, spec, initial)


class MurmuraClient:
    """A joined GrpcTransport that pushes the same payload under fresh update ids."""

    def __init__(self, address: str, spec: ModelSpec, payload: bytes) -> None:
        self.transport = GrpcTransport(address, timeout_s=TIMEOUT_S)
        joined, server_spec = self.transport.join("bench-client", DeviceProfile())
        if server_spec != spec:
            raise RuntimeError("the server announced a different model spec")
        self.session = joined.session
        self.fingerprint = spec.fingerprint()
        self.payload = payload
        self._ids = itertools.count()

    def header(self) -> UpdateHeader:
        return UpdateHeader(session=self.session, update_id=f"u{next(self._ids)}",
                            base_version=0, num_examples=32, codec="dense-f32",
                            payload_bytes=len(self.payload), spec_fingerprint=self.fingerprint)

    def push(self) -> Any:
        result = self.transport.push(self.header(), self.payload)
        if result.duplicate or result.version != 0:
            raise RuntimeError(f"unexpected push result {result}")
        return result

    def pull(self) -> Any:
        return self.transport.pull(self.session)


# -- measurement -----------------------------------------------------------------------------


def run(p: int, repeats: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nbytes = 4 * p
    payload = np.random.default_rng(2).standard_normal(p, dtype=np.float32).tobytes()
    core = make_core(p)
    server = ServerThread(core).start()
    raw_server = RawServer(core.params.tobytes()).start()  # raw pull streams the same model
    ours = MurmuraClient(server.address, core.spec, payload)
    raw = RawClient(raw_server.port)
    try:
        cases: dict[str, Callable[[], Any]] = {
            PUSH: ours.push,
            RAW_PUSH: lambda: raw.push(payload),
            PULL: ours.pull,
            RAW_PULL: raw.pull,
        }

        def check(name: str, out: Any) -> None:
            if name == RAW_PUSH and out != nbytes:
                raise AssertionError(f"raw server counted {out} bytes, sent {nbytes}")
            if name == RAW_PULL and out != nbytes:
                raise AssertionError(f"raw client received {out} bytes, expected {nbytes}")
            if name == PULL and not np.array_equal(out[1], core.params):
                raise AssertionError("pulled model differs from the server's")

        for name, fn in cases.items():  # warm: connections, first-touch of server buffers
            check(name, fn())
        times = interleaved(cases, repeats=repeats, check=check, label=f"{nbytes / 1e6:.0f} MB")
        buffered = server.call(lambda: core.policy.buffered())
        if buffered != len(times[PUSH]) + 1:
            raise AssertionError(f"the core holds {buffered} updates, "
                                 f"{len(times[PUSH]) + 1} were pushed")

        piece_times = time_pieces(core, server, ours, payload, repeats)
    finally:
        ours.transport.close()
        raw.close()
        server.stop()
        raw_server.stop()

    best = {k: min(v) for k, v in times.items()}
    peer = {PUSH: RAW_PUSH, RAW_PUSH: RAW_PUSH, PULL: RAW_PULL, RAW_PULL: RAW_PULL}
    rows = [{
        "direction": "push (upload)" if "push" in k else "pull (download)",
        "method": k, "mb": nbytes / 1e6, "best_s": best[k],
        "median_s": statistics.median(times[k]), "times_s": times[k],
        "mb_s": nbytes / 1e6 / best[k], "vs_raw": best[peer[k]] / best[k],
    } for k in (PUSH, RAW_PUSH, PULL, RAW_PULL)]
    breakdown: list[dict[str, Any]] = [
        {"piece": "murmura push, end to end (table above)", "best_ms": best[PUSH] * 1e3},
        {"piece": "raw push of the same bytes (table above)", "best_ms": best[RAW_PUSH] * 1e3},
        {"piece": "difference: what Murmura adds to the transfer",
         "best_ms": (best[PUSH] - best[RAW_PUSH]) * 1e3},
        *({"piece": k, "best_ms": min(v) * 1e3} for k, v in piece_times.items()),
    ]
    for b in breakdown:
        b["share"] = b["best_ms"] / (best[PUSH] * 1e3)
    return rows, breakdown


def time_pieces(core: AggregatorCore, server: ServerThread, ours: MurmuraClient,
                payload: bytes, repeats: int) -> dict[str, list[float]]:
    """Time, each on its own, the work a push does beyond moving bytes (best of ``repeats``).

    Each piece repeats, on the whole payload, a step of ``GrpcTransport.push`` or
    ``AggregatorServicer.Push`` as they are now (payload chunks framed by ``serde`` and read
    back as views, one join on the server); the raw peer only slices, sends and counts.
    """
    from murmura.aggregation import WeightedMean

    items = list(serde.iter_update_items(ours.header(), payload, CHUNK))
    frames = [serde.serialize_update_item(i) for i in items]
    views = [v for v in map(serde.deserialize_update_item, frames[1:])
             if isinstance(v, memoryview)]
    if sum(len(v) for v in views) != len(payload):
        raise AssertionError("payload frames did not read back as views")
    joined = b"".join(views)
    update = np.frombuffer(joined, dtype="<f4")
    fold = WeightedMean(update.size)
    fold.add(update, 1.0)  # touch the accumulator once, as a running server has

    pool = BufferPool()

    def reassemble(lease: ReceiveBuffer) -> None:
        at = 0
        for v in views:
            lease.write(at, v)
            at += len(v)

    def fresh_buffer() -> None:  # the servicer before receive buffers were reused
        reassemble(ReceiveBuffer(np.empty(len(payload), np.uint8), len(payload), pooled=False))

    def pooled_buffer() -> None:  # AggregatorServicer.Push now
        lease = pool.acquire(len(payload))
        reassemble(lease)
        pool.release(lease)

    pooled_buffer()  # the first lease allocates; a running server's are warm

    def raw_slices() -> list[bytes]:
        view = memoryview(payload)
        return [bytes(view[s:s + CHUNK]) for s in range(0, len(view), CHUNK)]

    pieces: dict[str, Callable[[], Any]] = {
        "raw client: slicing the payload into `bytes` chunks (for comparison)": raw_slices,
        "client: framing the chunks (`iter_update_items` + `serialize_update_item`)":
            lambda: [serde.serialize_update_item(i)
                     for i in serde.iter_update_items(ours.header(), payload, CHUNK)],
        "server: frames back to views (`deserialize_update_item`)":
            lambda: [serde.deserialize_update_item(f) for f in frames[1:]],
        "server: joining the views into one payload (`b\"\".join`)":
            lambda: b"".join(views),
        "server: copying the views into a fresh `np.empty` buffer (before buffer reuse)":
            fresh_buffer,
        "server: copying the views into a reused buffer (`BufferPool`, as `Push` does)":
            pooled_buffer,
        "server: `AggregatorCore.push` on the joined payload (no gRPC)":
            lambda: server.call(core.push, ours.header(), joined),
        "↳ of which the finite check (one `np.add.reduce` pass, as the core does it)":
            lambda: np.add.reduce(update, dtype=np.float32),
        "↳ of which `WeightedMean.add` (the fold)":
            lambda: fold.add(update, 1.0),
    }
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for _ in range(repeats):
        for k, fn in pieces.items():
            times[k].append(time_once(fn)[0])
    progress("timed the pieces of a push")
    return times


def plot(report: Report, rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [r["method"] for r in rows]
    bars = ax.bar(labels, [r["mb_s"] for r in rows],
                  color=["C0", "C7", "C0", "C7"])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("MB/s over loopback gRPC (best)")
    ax.set_title(f"{rows[0]['mb']:.0f} MB dense-f32 update, 1 MiB chunks"
                 f"{' (quick)' if report.quick else ''}")
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, __doc__.splitlines()[0], argv)
    p = SMOKE_PARAMS if args.smoke else QUICK_PARAMS if args.quick else FULL_PARAMS
    repeats = SMOKE_REPEATS if args.smoke else QUICK_REPEATS if args.quick else FULL_REPEATS
    report = Report(NAME, args.quick, params={"params": p, "payload_bytes": 4 * p,
                                              "chunk_bytes": CHUNK, "repeats": repeats})
    progress(f"pushing and pulling {4 * p / 1e6:.0f} MB, {repeats} interleaved rounds")
    rows, breakdown = run(p, repeats)

    report.note(
        f"One dense-f32 update of {p:,} float32 ({4 * p / 1e6:.0f} MB) in {CHUNK >> 20} MiB "
        f"chunks over loopback; best of {repeats} interleaved rounds after one warm-up each. "
        "\"÷ raw\" is the throughput as a fraction of raw gRPC's in the same direction. Both "
        "servers share this process with the client (a thread and event loop each), as in "
        "`murmura run`; MB = 10^6 bytes.")
    report.table("Throughput", [
        Column("direction", "direction"),
        Column("method", "method"),
        Column("mb", "MB", "{:.0f}"),
        Column("best_s", "best s", "{:.3f}"),
        Column("median_s", "median s", "{:.3f}"),
        Column("mb_s", "MB/s", "{:,.0f}"),
        Column("vs_raw", "÷ raw", "{:.2f}"),
    ], rows)
    report.table("Where a push's time goes (each piece timed alone on the whole payload, best "
                 "of the rounds; pieces overlap with the transfer, so they need not add up)", [
        Column("piece", "piece"),
        Column("best_ms", "ms", "{:.1f}"),
        Column("share", "÷ murmura push", "{:.2f}"),
    ], breakdown)

    def row(method: str) -> dict[str, Any]:
        return next(r for r in rows if r["method"] == method)

    report.target(f"murmura push ÷ raw gRPC push ({4 * p / 1e6:.0f} MB)", row(PUSH)["vs_raw"],
                  ">=", 0.6, detail=f"{row(PUSH)['mb_s']:,.0f} vs {row(RAW_PUSH)['mb_s']:,.0f} "
                                    "MB/s")
    report.note(f"Pull is not a target: murmura {row(PULL)['mb_s']:,.0f} MB/s vs raw "
                f"{row(RAW_PULL)['mb_s']:,.0f} MB/s, {row(PULL)['vs_raw']:.2f} of raw.",
                after_tables=True)
    plot(report, rows)
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
