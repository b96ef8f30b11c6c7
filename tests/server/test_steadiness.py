"""The swing watch: a run whose accuracy falls sharply from version to version is named once."""

from __future__ import annotations

import logging

import pytest

from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.server.steadiness import SwingWatch, swing_advice
from murmura.simulation import SimulationConfig, simulate
from murmura.tasks import TaskConfig


def test_two_sharp_drops_within_the_window_warn_once() -> None:
    watch = SwingWatch(drop=0.15, window=10, count=2)
    seen = [watch.see(v, a) for v, a in enumerate([0.5, 0.8, 0.6, 0.85, 0.9, 0.7, 0.4, 0.9])]
    assert seen[:5] == [[]] * 5  # 0.8 -> 0.6 is a drop of 0.2: one swing is not unsteady
    assert seen[5] == [(2, 0.8, 0.6), (5, 0.9, 0.7)]
    assert seen[6:] == [[], []]  # once per run
    assert watch.warned


def test_slow_declines_unmeasured_versions_and_old_drops_do_not_count() -> None:
    watch = SwingWatch(drop=0.15, window=5, count=2)
    assert all(not watch.see(v, a) for v, a in enumerate([0.9, 0.8, 0.7, 0.6, 0.5]))
    assert not watch.see(5, None) and not watch.see(6, float("nan"))
    assert not watch.see(7, 0.9) and not watch.see(8, 0.6)       # one drop at version 8
    for v in range(9, 14):
        assert not watch.see(v, 0.6)
    assert not watch.see(14, 0.9) and not watch.see(15, 0.7)     # version 8 left the window
    assert not watch.warned


@pytest.mark.parametrize("bad", [{"drop": 0.0}, {"drop": 1.0}, {"window": 1}, {"count": 0}])
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SwingWatch(**bad)


def test_the_advice_names_the_async_step_share_and_the_settings() -> None:
    text = swing_advice([(3, 0.9, 0.5)], mode="async", buffer_size=5, clients=10, server_lr=1.0)
    assert "0.90 -> 0.50 at version 3" in text
    assert "5 of the 10 clients" in text and "--buffer-size near 10" in text
    assert "--server-lr near 0.5" in text
    sync = swing_advice([(3, 0.9, 0.5)], mode="sync", buffer_size=5, clients=10, server_lr=2.0)
    assert "--server-lr (now 2)" in sync and "buffer" not in sync


def _run(caplog: pytest.LogCaptureFixture, tmp_path, **flat) -> list[str]:
    task = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
    server = ServerConfig.from_flat(max_versions=16, seed=0, **flat,
                                    train=TaskSettings(lr=0.1, local_epochs=1, batch_size=16))
    with caplog.at_level(logging.WARNING, logger="murmura.server"):
        simulate(task, server, SimulationConfig(clients=10, out=str(tmp_path)))
    return [r.getMessage() for r in caplog.records if "accuracy swings" in r.getMessage()]


def test_a_server_step_far_too_large_is_named_and_a_steady_run_is_not(caplog, tmp_path) -> None:
    # a server step of 4x the clients' mean update overshoots every version
    said = _run(caplog, tmp_path / "wild", mode="async", buffer_size=5, server_lr=4.0)
    assert len(said) == 1 and "--server-lr near" in said[0]
    caplog.clear()
    assert _run(caplog, tmp_path / "calm", mode="sync") == []
