"""Worker cold start (forkserver vs spawn) and warm dispatch latency of ProcessBackend.

* **cold start** — ``ProcessBackend.stats()["cold_start_last_s"]``: from the moment a job finds
  no worker to the moment the new worker says it is ready. With ``forkserver`` the first start
  also boots the forkserver, which imports the preload modules (torch among them) once; every
  later start forks that warm server. With ``spawn`` each start is a fresh interpreter that
  imports ``murmura.server`` (and so torch) again.
* **warm dispatch** — sequential tiny jobs on a warm worker: the round trip ``await run(...)``
  and the backend's dispatch latency (job submitted -> the worker starts running it).

A small script, not part of the benchmark suite's report: it prints a markdown table and saves
nothing. Run: ``python benchmarks/worker_coldstart.py [--starts N] [--jobs N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from murmura.server import _testjobs as jobs  # noqa: E402
from murmura.server.workers import InlineBackend, ProcessBackend  # noqa: E402


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


async def measure(starts: int, n_jobs: int) -> None:
    fork = await cold_starts("forkserver", starts + 1)
    spawn = await cold_starts("spawn", starts)
    trips, dispatch, inline = await warm(n_jobs)
    print("| what | value |")
    print("|---|---|")
    print(f"| forkserver, first cold start (boots the forkserver, imports preload) | "
          f"{ms(fork[0])} |")
    print(f"| forkserver, later cold starts (median of {starts}) | "
          f"{ms(statistics.median(fork[1:]))} (min {ms(min(fork[1:]))}) |")
    print(f"| spawn, cold start (median of {starts}) | {ms(statistics.median(spawn))} "
          f"(min {ms(min(spawn))}) |")
    print(f"| warm round trip `await run(add)` (median of {n_jobs}) | "
          f"{ms(statistics.median(trips))} (p90 {ms(statistics.quantiles(trips, n=10)[-1])}) |")
    print(f"| warm dispatch latency, submit -> worker starts the job (mean) | {ms(dispatch)} |")
    print(f"| inline round trip (median) | {ms(statistics.median(inline))} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5, help="cold starts per start method")
    parser.add_argument("--jobs", type=int, default=300, help="warm jobs timed")
    args = parser.parse_args(argv)
    asyncio.run(measure(args.starts, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
