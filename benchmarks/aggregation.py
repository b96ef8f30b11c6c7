"""Streaming FedAvg throughput: Murmura's WeightedMean against the memory roofline and Flower.

N client updates of P float32 values are averaged, each method starting from the
representation it receives off the wire:

* **murmura** — the dense-f32 payload bytes the server assembled (a ``memoryview``), decoded
  by the codec (``np.frombuffer``) and folded into ``murmura.aggregation.WeightedMean`` one
  update at a time (``add(update, weight)`` under ``one_torch_thread``, as the server's
  publisher runs each fold), then ``result()``;
* **roofline** — numpy summing the same vectors into one float32 accumulator
  (``np.add(acc, x, out=acc)``): one read of every input, the least any aggregation can do;
* **flwr current** — ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords``, the
  path of Flower's ``FedAvg.aggregate_train``: a list of ``RecordDict`` (one reply's content
  each) holding an ``ArrayRecord`` whose ``Array`` carries the ``.npy`` bytes Flower puts on the
  wire (what ``Array.inflate`` rebuilds), plus a ``MetricRecord`` with the weighting key;
  the function's own ``Array.numpy()`` conversion is part of what is timed;
* **flwr legacy** — ``flwr.server.strategy.aggregate.aggregate``, on ``[(NDArrays,
  num_examples)]`` (numpy arrays over the same bytes).

All four read the same N byte buffers (no method's input costs memory the others' do not).
GB/s = N * P * 4 bytes / seconds. Peak memory is the accumulator overhead beyond the inputs,
measured as the peak-RSS increase during the call (and, as a cross-check, the peak of traced
numpy/Python allocations), for two N at the same P.

Run: ``python benchmarks/aggregation.py [--quick | --smoke]``.
"""

from __future__ import annotations

import io
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import (  # noqa: E402
    Column,
    Report,
    interleaved,
    parse_args,
    peak_rss_delta,
    peak_traced_delta,
    progress,
    pyplot,
)

NAME = "aggregation"
WEIGHT_KEY = "num-examples"  # flwr FedAvg's default ``weighted_by_key``
SEED = 20240601

OURS, ROOF, FLWR, LEGACY = "murmura", "roofline", "flwr current", "flwr legacy"
OURS_1T = "murmura, 1 torch thread"
METHODS = (OURS, ROOF, FLWR, LEGACY, OURS_1T)
DESCRIPTION = {
    OURS: "WeightedMean.add per update (under one_torch_thread, as the server folds), then "
          "result()",
    ROOF: "numpy acc += x (memory roofline)",
    FLWR: "strategy_utils.aggregate_arrayrecords",
    LEGACY: "server.strategy.aggregate.aggregate",
    OURS_1T: "diagnostic, not a target: the same under torch.set_num_threads(1)",
}


@dataclass(frozen=True)
class Plan:
    n: int
    sizes: tuple[int, ...]          # P values
    repeats: dict[int, int]         # P -> timed rounds
    memory_ns: tuple[int, int]      # two N at the largest P for the memory probe


FULL = Plan(n=100, sizes=(1_000_000, 10_000_000), repeats={1_000_000: 9, 10_000_000: 5},
            memory_ns=(20, 100))
QUICK = Plan(n=20, sizes=(1_000_000, 4_000_000), repeats={1_000_000: 7, 4_000_000: 5},
             memory_ns=(5, 20))
SMOKE = Plan(n=4, sizes=(10_000, 40_000), repeats={10_000: 2, 40_000: 2}, memory_ns=(2, 4))


# -- inputs: what each method receives off the wire ------------------------------------------


@dataclass
class Inputs:
    p: int
    wire: list[bytes]          # Flower's Array.data: the .npy bytes, as inflated from chunks
    views: list[memoryview]    # Murmura's dense-f32 payload: the same values' raw bytes
    weights: list[int]         # examples per client

    def head(self, n: int) -> Inputs:
        return Inputs(self.p, self.wire[:n], self.views[:n], self.weights[:n])


def _npy_data_offset(data: bytes) -> int:
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    _shape, _fortran, dtype = read_header(f)
    if dtype != np.dtype("<f4"):
        raise ValueError(f"expected little-endian float32, got {dtype}")
    return f.tell()


def make_inputs(n: int, p: int) -> Inputs:
    """N updates, each drawn from its own seeded generator and serialised once by Flower's
    own ``Array(ndarray)`` (``np.save``), as a Flower client would send it."""
    from flwr.app import Array

    wire: list[bytes] = []
    views: list[memoryview] = []
    buf = np.empty(p, dtype=np.float32)
    for i in range(n):
        np.random.default_rng([SEED, p, i]).standard_normal(out=buf, dtype=np.float32)
        data = Array(buf).data
        wire.append(data)
        views.append(memoryview(data)[_npy_data_offset(data):])
    weights = [10 + (37 * i) % 90 for i in range(n)]
    return Inputs(p, wire, views, weights)


def check_flower_wire_form() -> None:
    """The Arrays built here are what Flower's deserialiser rebuilds: check on a small one."""
    from flwr.app import Array

    sent = Array(np.arange(1000, dtype=np.float32))
    received = Array.inflate(sent.deflate(), children=sent.children)
    assert isinstance(received.data, bytes) and received.data == sent.data
    assert (received.dtype, tuple(received.shape), received.stype) == \
        (sent.dtype, tuple(sent.shape), sent.stype)


# -- the four methods ------------------------------------------------------------------------


def murmura_case(inp: Inputs) -> Callable[[], Any]:
    from murmura.aggregation import WeightedMean
    from murmura.protocols import create_codec
    from murmura.protocols.codecs import one_torch_thread

    codec = create_codec("dense-f32", {})

    def run() -> Any:
        agg = WeightedMean(inp.p)
        for payload, w in zip(inp.views, inp.weights, strict=True):
            with one_torch_thread():  # as the server's publisher runs every fold
                agg.add(codec.decode(payload, inp.p), float(w))
        return agg.result()

    return run


def murmura_one_thread_case(inp: Inputs) -> Callable[[], Any]:
    """Diagnostic: WeightedMean with torch's intra-op parallelism off for the whole process
    (a multi-threaded add_ splits every update over all cores and waits for the slowest)."""
    import torch

    run_ours = murmura_case(inp)

    def run() -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run_ours()
        finally:
            torch.set_num_threads(threads)

    return run


def roofline_case(inp: Inputs) -> Callable[[], Any]:
    def run() -> np.ndarray:
        acc = np.zeros(inp.p, dtype=np.float32)
        for payload in inp.views:
            np.add(acc, np.frombuffer(payload, dtype="<f4"), out=acc)
        return acc

    return run


def flwr_current_case(inp: Inputs) -> Callable[[], Any]:
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.common.constant import SType
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    records = [
        RecordDict({
            "arrays": ArrayRecord({"weights": Array(dtype="float32", shape=(inp.p,),
                                                    stype=SType.NUMPY, data=data)}),
            "metrics": MetricRecord({WEIGHT_KEY: w}),
        })
        for data, w in zip(inp.wire, inp.weights, strict=True)
    ]

    def run() -> Any:
        return aggregate_arrayrecords(records, WEIGHT_KEY)

    return run


def flwr_legacy_case(inp: Inputs) -> Callable[[], Any]:
    from flwr.server.strategy.aggregate import aggregate

    results = [([np.frombuffer(v, dtype="<f4")], w)
               for v, w in zip(inp.views, inp.weights, strict=True)]

    def run() -> Any:
        return aggregate(results)

    return run


CASES: dict[str, Callable[[Inputs], Callable[[], Any]]] = {
    OURS: murmura_case, ROOF: roofline_case, FLWR: flwr_current_case, LEGACY: flwr_legacy_case,
    OURS_1T: murmura_one_thread_case,
}


def as_vector(method: str, out: Any) -> np.ndarray | None:
    if method in (OURS, OURS_1T):
        return np.asarray(out)
    if method == FLWR:
        return np.asarray(next(iter(out.values())).numpy())
    if method == LEGACY:
        return np.asarray(out[0])
    return None  # the roofline sums without weights


def expected_mean(inp: Inputs) -> np.ndarray:
    acc = np.zeros(inp.p, dtype=np.float64)
    for v, w in zip(inp.views, inp.weights, strict=True):
        acc += w * np.frombuffer(v, dtype="<f4")
    return acc / sum(inp.weights)


# -- measurement -----------------------------------------------------------------------------


def measure_speed(inp: Inputs, n: int, repeats: int) -> list[dict[str, Any]]:
    cases = {m: CASES[m](inp) for m in METHODS}
    reference = expected_mean(inp)

    def check(method: str, out: Any) -> None:
        vec = as_vector(method, out)
        if vec is not None and not np.allclose(vec, reference, rtol=1e-4, atol=1e-5):
            err = float(np.max(np.abs(vec - reference)))
            raise AssertionError(f"{method} disagrees with the float64 mean (max error {err})")

    times = interleaved(cases, repeats=repeats, check=check, label=f"P={inp.p:,}")
    nbytes = n * inp.p * 4
    best = {m: min(ts) for m, ts in times.items()}
    return [{
        "p": inp.p, "n": n, "method": m, "what": DESCRIPTION[m],
        "best_s": best[m], "median_s": statistics.median(times[m]), "times_s": times[m],
        "gb_s": nbytes / best[m] / 1e9,
        "ours_vs_this": best[m] / best[OURS],  # ours' speed as a multiple of this method's
    } for m in METHODS]


def measure_memory(inp: Inputs, ns: tuple[int, int]) -> list[dict[str, Any]]:
    rows = []
    for m in (OURS, FLWR, LEGACY):
        row: dict[str, Any] = {"p": inp.p, "method": m, "n_small": ns[0], "n_large": ns[1]}
        for tag, n in zip(("small", "large"), ns, strict=True):
            case = CASES[m](inp.head(n))
            case()  # warm: first-call allocations (torch, imports) are not per-N costs
            row[f"rss_{tag}"] = peak_rss_delta(case)
            row[f"traced_{tag}"] = peak_traced_delta(case)
            progress(f"memory {m} N={n}: peak RSS +{_mb(row[f'rss_{tag}'])} MB, "
                     f"traced +{_mb(row[f'traced_{tag}'])} MB")
        key = "rss" if row["rss_small"] is not None else "traced"
        row["measure"] = "peak RSS" if key == "rss" else "tracemalloc"
        row["ratio"] = row[f"{key}_large"] / max(row[f"{key}_small"], 1)
        row["large_bytes"] = row[f"{key}_large"]
        row["model_mb"] = inp.p * 4 / 1e6
        rows.append(row)
    return rows


def _mb(nbytes: int | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e6:,.0f}"


# -- report ----------------------------------------------------------------------------------


def plot(report: Report, rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    sizes = sorted({r["p"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(METHODS)
    for j, m in enumerate(METHODS):
        picked = [next(r for r in rows if r["p"] == p and r["method"] == m) for p in sizes]
        xs = [i + (j - (len(METHODS) - 1) / 2) * width for i in range(len(sizes))]
        bars = ax.bar(xs, [r["gb_s"] for r in picked], width, label=m)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.scatter(xs, [r["n"] * r["p"] * 4 / r["median_s"] / 1e9 for r in picked], s=10,
                   color="black", zorder=3, label="median" if j == 0 else None)
    ax.set_xticks(range(len(sizes)), [f"P = {p / 1e6:g}M" for p in sizes])
    ax.set_ylabel("GB/s of updates aggregated (bar: best)")
    n = rows[0]["n"]
    ax.set_title(f"FedAvg of N = {n} float32 updates{' (quick)' if report.quick else ''}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, __doc__.splitlines()[0], argv)
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    report = Report(NAME, args.quick, params={
        "n": plan.n, "sizes": list(plan.sizes), "repeats": plan.repeats,
        "memory_ns": list(plan.memory_ns), "weighting_key": WEIGHT_KEY})
    check_flower_wire_form()

    speed_rows: list[dict[str, Any]] = []
    memory_rows: list[dict[str, Any]] = []
    for p in plan.sizes:
        progress(f"generating {plan.n} updates of {p:,} float32 ({plan.n * p * 4 / 1e9:.1f} GB)")
        inp = make_inputs(plan.n, p)
        speed_rows += measure_speed(inp, plan.n, plan.repeats[p])
        if p == max(plan.sizes):
            memory_rows = measure_memory(inp, plan.memory_ns)
        del inp

    report.note(
        f"N = {plan.n} updates of P float32 values; best of {min(plan.repeats.values())}–"
        f"{max(plan.repeats.values())} interleaved rounds. GB/s = N·P·4 bytes / best time. "
        "\"ours ×\" is Murmura's speed as a multiple of that method's (below 1: slower). "
        "Each method starts from its wire representation: Murmura from the dense-f32 payload "
        "bytes, Flower's current function from ArrayRecords of .npy bytes (its Array.numpy() "
        "conversion included), the legacy function from numpy arrays.")
    report.table("Throughput", [
        Column("p", "P", lambda v: f"{v / 1e6:g}M"),
        Column("n", "N"),
        Column("method", "method"),
        Column("what", "what runs"),
        Column("best_s", "best s", "{:.3f}"),
        Column("median_s", "median s", "{:.3f}"),
        Column("gb_s", "GB/s", "{:.2f}"),
        Column("ours_vs_this", "ours ×", "{:.2f}"),
    ], speed_rows)
    report.table("Peak memory beyond the inputs (accumulator overhead)", [
        Column("p", "P", lambda v: f"{v / 1e6:g}M"),
        Column("method", "method"),
        Column("rss_small", "peak RSS +MB, N small", _mb),
        Column("rss_large", "peak RSS +MB, N large", _mb),
        Column("traced_small", "traced +MB, N small", _mb),
        Column("traced_large", "traced +MB, N large", _mb),
        Column("ratio", "large ÷ small", "{:.2f}"),
    ], [{**r, "method": f"{r['method']} (N = {r['n_small']} / {r['n_large']})"}
        for r in memory_rows])

    def speed(p: int, m: str) -> float:
        return float(next(r["gb_s"] for r in speed_rows if r["p"] == p and r["method"] == m))

    for p in plan.sizes:
        report.target(f"murmura ÷ roofline at P = {p / 1e6:g}M", speed(p, OURS) / speed(p, ROOF),
                      ">=", 0.85, detail=f"{speed(p, OURS):.2f} vs {speed(p, ROOF):.2f} GB/s")
    big = max(plan.sizes)
    report.target(f"murmura ÷ flwr current at P = {big / 1e6:g}M",
                  speed(big, OURS) / speed(big, FLWR), ">=", 3.0, unit="x",
                  detail=f"{speed(big, OURS):.2f} vs {speed(big, FLWR):.2f} GB/s")
    ours_mem = next(r for r in memory_rows if r["method"] == OURS)
    report.target(f"murmura peak memory, N = {plan.memory_ns[1]} ÷ N = {plan.memory_ns[0]}",
                  ours_mem["ratio"], "<=", 1.1,
                  detail=f"{ours_mem['measure']} at P = {big / 1e6:g}M: "
                         f"+{_mb(ours_mem['large_bytes'])} MB for a "
                         f"{ours_mem['model_mb']:.0f} MB model")
    threads = report.machine.get("torch_threads")
    report.note(
        f"Diagnostic: the last row runs the same WeightedMean code with torch limited to one "
        f"thread for the whole process (torch has {threads} intra-op threads here): "
        + "; ".join(f"at P = {p / 1e6:g}M {speed(p, OURS_1T) / speed(p, ROOF):.2f} of the "
                    f"roofline against {speed(p, OURS) / speed(p, ROOF):.2f} as shipped"
                    for p in plan.sizes)
        + ". A gap between the two means torch's intra-op threading is slowing the fold (a "
        "split update waits for its slowest thread, which on a busy machine costs a "
        "scheduler slice per update); compare the medians as well.",
        after_tables=True)
    plot(report, speed_rows)
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
