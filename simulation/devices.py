"""Simulated devices: how fast each client computes and talks, and when it is online.

Per-client properties live in a few numpy arrays (struct of arrays), not in one object per
client, so ten thousand clients cost a few hundred kilobytes here. Everything is drawn from
seeded generators: the same seed gives the same population.

* Compute: seconds per local step, log-uniform between ``step_time_s`` (the fastest device)
  and ``step_time_s * speed_spread`` (the slowest), or read from a trace file.
* Network: uplink and downlink bandwidth (log-uniform between the best link and the best
  divided by ``bandwidth_spread``) and a one-way latency per client.
* Availability: always online; on/off churn with exponentially distributed periods; or online
  intervals from a trace file. A client that goes offline loses whatever it was training.
"""

from __future__ import annotations

import csv
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

#: Columns a device trace may have; ``step_time_s`` is required, the rest default to the config.
DEVICE_TRACE_COLUMNS = ("step_time_s", "uplink_mbps", "downlink_mbps", "latency_ms")


def log_uniform(rng: np.random.Generator, low: float, high: float, n: int) -> F64:
    """``n`` values whose logarithm is uniform on [log low, log high]."""
    if not 0 < low <= high:
        raise ValueError(f"log-uniform needs 0 < low <= high, got {low}, {high}")
    if low == high:
        return np.full(n, low, dtype=np.float64)
    return np.exp(rng.uniform(math.log(low), math.log(high), size=n))


def mbps_to_bytes_per_s(mbps: float | F64) -> float | F64:
    return mbps * 1e6 / 8.0


@dataclass(frozen=True)
class DevicePopulation:
    """Compute and network properties of every simulated client (arrays of length ``n``)."""

    step_time_s: F64
    uplink_bytes_per_s: F64
    downlink_bytes_per_s: F64
    latency_s: F64

    def __post_init__(self) -> None:
        n = len(self.step_time_s)
        for name in ("uplink_bytes_per_s", "downlink_bytes_per_s", "latency_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected {n}")
        if n and not (np.all(self.step_time_s > 0) and np.all(self.uplink_bytes_per_s > 0)
                      and np.all(self.downlink_bytes_per_s > 0) and np.all(self.latency_s >= 0)):
            raise ValueError("step times and bandwidths must be positive, latencies >= 0")

    def __len__(self) -> int:
        return len(self.step_time_s)

    @classmethod
    def sample(cls, n: int, *, seed: int, step_time_s: float, speed_spread: float,
               uplink_mbps: float, downlink_mbps: float, latency_ms: float,
               bandwidth_spread: float = 1.0, stragglers: float = 0.0,
               straggler_factor: float = 1.0) -> DevicePopulation:
        """Draw ``n`` devices: compute and bandwidth log-uniform over their spreads; a seeded
        ``stragglers`` fraction of them (rounded to whole clients) compute
        ``straggler_factor`` times slower."""
        if not (0 <= stragglers <= 1 and straggler_factor >= 1):
            raise ValueError("stragglers must lie in [0, 1] and straggler_factor be >= 1")
        if n < 1:
            raise ValueError(f"need at least one client, got {n}")
        if speed_spread < 1 or bandwidth_spread < 1:
            raise ValueError("speed_spread and bandwidth_spread must be >= 1")
        rng = np.random.default_rng([seed, 0x5EED, 1])
        step = log_uniform(rng, step_time_s, step_time_s * speed_spread, n)
        up = log_uniform(rng, uplink_mbps / bandwidth_spread, uplink_mbps, n)
        down = log_uniform(rng, downlink_mbps / bandwidth_spread, downlink_mbps, n)
        slow = round(stragglers * n)
        if slow:  # drawn from its own stream: the other devices stay as without stragglers
            pick = np.random.default_rng([seed, 0x5EED, 2]).choice(n, size=slow, replace=False)
            step[pick] *= straggler_factor
        return cls(step, np.asarray(mbps_to_bytes_per_s(up)),
                   np.asarray(mbps_to_bytes_per_s(down)), np.full(n, latency_ms / 1e3))

    @classmethod
    def from_trace(cls, path: str | Path, n: int, *, uplink_mbps: float, downlink_mbps: float,
                   latency_ms: float) -> DevicePopulation:
        """Devices from a CSV (header row) or JSON (list of objects) file, one per row.

        Columns: ``step_time_s`` (required), ``uplink_mbps``, ``downlink_mbps``,
        ``latency_ms``. Client ``i`` takes row ``i % rows``, so a short trace of measured
        devices can populate a large simulation.
        """
        rows = _read_rows(path)
        if not rows:
            raise ValueError(f"device trace {path} has no rows")
        unknown = set(rows[0]) - set(DEVICE_TRACE_COLUMNS)
        if unknown:
            raise ValueError(f"device trace {path}: unknown column(s) {sorted(unknown)}; "
                             f"known: {', '.join(DEVICE_TRACE_COLUMNS)}")

        def column(key: str, default: float | None) -> F64:
            values = []
            for k, row in enumerate(rows):
                raw = row.get(key, default)
                if raw in (None, ""):
                    if default is None:
                        raise ValueError(f"device trace {path}: row {k + 1} has no {key}")
                    raw = default
                try:
                    values.append(float(raw))  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    raise ValueError(f"device trace {path}: row {k + 1}: {key}={raw!r} is not "
                                     f"a number") from None
            return np.asarray(values, dtype=np.float64)[np.arange(n) % len(rows)]

        return cls(column("step_time_s", None),
                   np.asarray(mbps_to_bytes_per_s(column("uplink_mbps", uplink_mbps))),
                   np.asarray(mbps_to_bytes_per_s(column("downlink_mbps", downlink_mbps))),
                   column("latency_ms", latency_ms) / 1e3)


def _read_rows(path: str | Path) -> list[dict[str, object]]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"trace file {path} does not exist") from None
    if path.suffix.lower() == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: a JSON trace is a list of objects")
        return data
    return [dict(r) for r in csv.DictReader(text.splitlines())]


# -- availability ----------------------------------------------------------------------------


class Availability(ABC):
    """When each client is online. Queried lazily, one transition at a time."""

    @abstractmethod
    def initial(self, client: int) -> tuple[bool, float]:
        """(online at time 0, time of its first transition; ``inf`` for never)."""

    @abstractmethod
    def next_transition(self, client: int, now: float, online: bool) -> float:
        """Time of the next transition after ``now``, given the state just entered."""


class AlwaysOn(Availability):
    """Every client is online for the whole run."""

    def initial(self, client: int) -> tuple[bool, float]:
        return True, math.inf

    def next_transition(self, client: int, now: float, online: bool) -> float:
        return math.inf


class Churn(Availability):
    """Alternating online/offline periods, exponentially distributed (a two-state Markov chain).

    At time 0 a client is online with the stationary probability
    ``mean_online_s / (mean_online_s + mean_offline_s)``. Draws come from a generator keyed
    by (seed, client, period), so they don't depend on the order clients are asked in, and the
    only per-client state is a period counter.
    """

    def __init__(self, n: int, *, mean_online_s: float, mean_offline_s: float,
                 seed: int) -> None:
        if not (mean_online_s > 0 and mean_offline_s > 0):
            raise ValueError("mean_online_s and mean_offline_s must be positive")
        self.mean_online_s = mean_online_s
        self.mean_offline_s = mean_offline_s
        self.seed = seed
        self._period = np.zeros(n, dtype=np.int32)

    def _draw(self, client: int) -> float:
        k = int(self._period[client])
        self._period[client] = k + 1
        return float(np.random.default_rng([self.seed, 0xC0FFEE, client, k]).random())

    def initial(self, client: int) -> tuple[bool, float]:
        p_online = self.mean_online_s / (self.mean_online_s + self.mean_offline_s)
        online = self._draw(client) < p_online
        return online, self.next_transition(client, 0.0, online)

    def next_transition(self, client: int, now: float, online: bool) -> float:
        mean = self.mean_online_s if online else self.mean_offline_s
        return now - mean * math.log1p(-self._draw(client))


class TraceAvailability(Availability):
    """Online intervals read from a file: CSV ``client,start_s,end_s`` (or JSON objects).

    Client ``i`` follows trace client ``i % K`` where the trace names clients ``0..K-1``; a
    client is offline outside its intervals.
    """

    def __init__(self, intervals: Sequence[Sequence[tuple[float, float]]]) -> None:
        if not intervals:
            raise ValueError("an availability trace needs at least one client")
        self._bounds: list[F64] = []
        for k, spans in enumerate(intervals):
            spans = sorted(spans)
            flat: list[float] = []
            for start, end in spans:
                if not (0 <= start < end):
                    raise ValueError(f"trace client {k}: interval ({start}, {end}) is empty "
                                     f"or negative")
                if flat and start <= flat[-1]:
                    if end > flat[-1]:
                        flat[-1] = end  # merge overlapping or touching intervals
                    continue
                flat += [start, end]
            self._bounds.append(np.asarray(flat, dtype=np.float64))

    @classmethod
    def from_file(cls, path: str | Path) -> TraceAvailability:
        rows = _read_rows(path)
        spans: dict[int, list[tuple[float, float]]] = {}
        for k, row in enumerate(rows):
            try:
                c = int(str(row["client"]))
                s, e = float(str(row["start_s"])), float(str(row["end_s"]))
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"availability trace {path}: row {k + 1} needs numeric "
                                 f"client, start_s and end_s") from None
            spans.setdefault(c, []).append((s, e))
        if not spans or min(spans) < 0:
            raise ValueError(f"availability trace {path}: clients must be numbered from 0")
        return cls([spans.get(c, []) for c in range(max(spans) + 1)])

    def _for(self, client: int) -> F64:
        return self._bounds[client % len(self._bounds)]

    def initial(self, client: int) -> tuple[bool, float]:
        b = self._for(client)
        i = int(np.searchsorted(b, 0.0, side="right"))
        return i % 2 == 1, float(b[i]) if i < len(b) else math.inf

    def next_transition(self, client: int, now: float, online: bool) -> float:
        b = self._for(client)
        i = int(np.searchsorted(b, now, side="right"))
        return float(b[i]) if i < len(b) else math.inf


__all__ = [
    "DEVICE_TRACE_COLUMNS",
    "AlwaysOn",
    "Availability",
    "Churn",
    "DevicePopulation",
    "TraceAvailability",
    "log_uniform",
    "mbps_to_bytes_per_s",
]
