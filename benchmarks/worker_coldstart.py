"""Worker cold start (forkserver vs spawn) and warm dispatch latency of ProcessBackend.

* **cold start** — ``ProcessBackend.stats()["cold_start_last_s"]``: from the moment a job finds
  no worker to the moment the new worker says it is ready. With ``forkserver`` the first start
  also boots the forkserver, which imports the preload modules (torch among them) once; every
  later start forks that warm server. With ``spawn`` each start is a fresh interpreter that
  imports ``murmura.server`` (and so torch) again.
* **warm dispatch** — sequential tiny jobs on a warm worker: the round trip ``await run(...)``
  and the backend's dispatch latency (job submitted -> the worker starts running it).

It writes ``results/worker_coldstart.json`` and its RESULTS.md section like every benchmark;
the one target is that forkserver starts stay far cheaper than spawn's.
Run: ``python benchmarks/worker_coldstart.py [--quick | --smoke] [--starts N] [--jobs N]``
(``--quick`` times the same as a full run: it takes under a minute).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args  # noqa: E402
from murmura.server import _testjobs as jobs  # noqa: E402
from murmura.server.process_backend import ProcessBackend  # noqa: E402
from murmura.server.workers import InlineBackend  # noqa: E402


async def cold_starts(method: str, n: int) -> list[float]:
    """Seconds of ``n`` cold starts, each a new backend's first job."""
    times = []
    for _ in range(n):
        backend = ProcessBackend(1, start_method=method)
        try:
            await backend.run(jobs.add, 1, 2)
            times.append(backend.stats()["cold_start_last_s"])
        finally:
            await backend.close()
    return times


async def warm(n: int) -> tuple[list[float], float, list[float]]:
    backend = ProcessBackend(1)
    try:
        await backend.run(jobs.add, 0, 0)  # the cold start
        trips = []
        for i in range(n):
            t = time.perf_counter()
            await backend.run(jobs.add, i, 1)
            trips.append(time.perf_counter() - t)
        dispatch = backend.stats()["warm_dispatch_latency_mean_s"]
    finally:
        await backend.close()
    inline = InlineBackend()
    inline_trips = []
    for i in range(n):
        t = time.perf_counter()
        await inline.run(jobs.add, i, 1)
        inline_trips.append(time.perf_counter() - t)
    return trips, dispatch, inline_trips


def ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


async def measure(report: Report, starts: int, n_jobs: int) -> None:
    fork = await cold_starts("forkserver", starts + 1)
    spawn = await cold_starts("spawn", starts)
    trips, dispatch, inline = await warm(n_jobs)
    rows = [
        {"what": "forkserver, first cold start (boots the forkserver, imports preload)",
         "value": ms(fork[0]), "seconds": fork[0]},
        {"what": f"forkserver, later cold starts (median of {starts})",
         "value": f"{ms(statistics.median(fork[1:]))} (min {ms(min(fork[1:]))})",
         "seconds": statistics.median(fork[1:])},
        {"what": f"spawn, cold start (median of {starts})",
         "value": f"{ms(statistics.median(spawn))} (min {ms(min(spawn))})",
         "seconds": statistics.median(spawn)},
        {"what": f"warm round trip `await run(add)` (median of {n_jobs})",
         "value": f"{ms(statistics.median(trips))} "
                  f"(p90 {ms(statistics.quantiles(trips, n=10)[-1])})",
         "seconds": statistics.median(trips)},
        {"what": "warm dispatch latency, submit -> worker starts the job (mean)",
         "value": ms(dispatch), "seconds": dispatch},
        {"what": "inline round trip (median)", "value": ms(statistics.median(inline)),
         "seconds": statistics.median(inline)},
    ]
    report.table("Worker cold start and warm dispatch", [Column("what", "what"),
                                                          Column("value", "value")], rows)
    report.target("spawn cold start ÷ later forkserver cold start (medians)",
                  statistics.median(spawn) / statistics.median(fork[1:]), ">=", 10, unit="x",
                  detail="docs/functions.md measured about 100x")


def main(argv: list[str] | None = None) -> int:
    def extra(parser: Any) -> None:
        parser.add_argument("--starts", type=int, default=None,
                            help="cold starts per start method (default 5; smoke 1)")
        parser.add_argument("--jobs", type=int, default=None,
                            help="warm jobs timed (default 300; smoke 10)")

    args = parse_args("worker_coldstart", __doc__.splitlines()[0], argv, extra)
    starts = args.starts or (1 if args.smoke else 5)
    n_jobs = args.jobs or (10 if args.smoke else 300)
    report = Report("worker_coldstart", quick=args.quick,
                    params={"starts": starts, "jobs": n_jobs})
    asyncio.run(measure(report, starts, n_jobs))
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
