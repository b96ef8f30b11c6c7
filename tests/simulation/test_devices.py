"""Device populations and availability: seeded, within their spreads, traces cycled."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from murmura.simulation import AlwaysOn, Churn, DevicePopulation, TraceAvailability


def test_compute_times_are_log_uniform_over_the_speed_spread() -> None:
    d = DevicePopulation.sample(20_000, seed=1, step_time_s=0.01, speed_spread=10.0,
                                uplink_mbps=8.0, downlink_mbps=80.0, latency_ms=30.0,
                                bandwidth_spread=4.0)
    assert d.step_time_s.min() >= 0.01 and d.step_time_s.max() <= 0.1
    assert d.step_time_s.max() / d.step_time_s.min() > 9.5  # the whole 10x range is used
    logs = np.log10(d.step_time_s / 0.01)  # uniform on [0, 1]
    assert abs(np.median(logs) - 0.5) < 0.02
    assert d.uplink_bytes_per_s.max() <= 1e6 and d.uplink_bytes_per_s.min() >= 1e6 / 4
    assert np.all(d.latency_s == 0.03)


def test_same_seed_same_population_other_seed_other_population() -> None:
    kw = dict(step_time_s=0.01, speed_spread=10.0, uplink_mbps=8.0, downlink_mbps=80.0,
              latency_ms=30.0)
    a = DevicePopulation.sample(100, seed=3, **kw)
    assert np.array_equal(a.step_time_s, DevicePopulation.sample(100, seed=3, **kw).step_time_s)
    assert not np.array_equal(a.step_time_s,
                              DevicePopulation.sample(100, seed=4, **kw).step_time_s)


def test_device_trace_rows_are_cycled_over_clients(tmp_path: Path) -> None:
    trace = tmp_path / "devices.csv"
    trace.write_text("step_time_s,uplink_mbps,latency_ms\n0.5,8,10\n0.05,,100\n")
    d = DevicePopulation.from_trace(trace, 5, uplink_mbps=2.0, downlink_mbps=16.0,
                                    latency_ms=1.0)
    assert d.step_time_s.tolist() == [0.5, 0.05, 0.5, 0.05, 0.5]
    assert d.uplink_bytes_per_s.tolist() == [1e6, 2.5e5, 1e6, 2.5e5, 1e6]  # blank: default
    assert d.downlink_bytes_per_s.tolist() == [2e6] * 5
    assert d.latency_s.tolist() == [0.01, 0.1, 0.01, 0.1, 0.01]
    bad = tmp_path / "bad.csv"
    bad.write_text("step_time,foo\n1,2\n")
    with pytest.raises(ValueError, match="unknown column"):
        DevicePopulation.from_trace(bad, 3, uplink_mbps=1, downlink_mbps=1, latency_ms=1)


def test_churn_is_deterministic_and_spends_the_expected_share_online() -> None:
    a = Churn(2000, mean_online_s=300.0, mean_offline_s=100.0, seed=9)
    b = Churn(2000, mean_online_s=300.0, mean_offline_s=100.0, seed=9)
    online_time = 0.0
    horizon = 3000.0
    for c in range(2000):
        state, t = a.initial(c)
        assert (state, t) == b.initial(c)
        now = 0.0
        while now < horizon:
            end = min(t, horizon)
            if state:
                online_time += end - now
            now, state = end, not state
            t = a.next_transition(c, now, state)
    share = online_time / (2000 * horizon)
    assert abs(share - 0.75) < 0.02  # mean_online / (mean_online + mean_offline)


def test_trace_availability_follows_the_intervals(tmp_path: Path) -> None:
    trace = tmp_path / "avail.csv"
    trace.write_text("client,start_s,end_s\n0,0,10\n0,20,30\n1,5,15\n1,12,18\n")
    av = TraceAvailability.from_file(trace)
    assert av.initial(0) == (True, 10.0)
    assert av.next_transition(0, 10.0, False) == 20.0
    assert av.next_transition(0, 30.0, False) == math.inf
    assert av.initial(1) == (False, 5.0)
    assert av.next_transition(1, 5.0, True) == 18.0  # overlapping intervals merge
    assert av.initial(2) == av.initial(0)  # client 2 follows trace client 0
    assert AlwaysOn().initial(7) == (True, math.inf)
