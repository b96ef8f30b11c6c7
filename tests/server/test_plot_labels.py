"""Plots say which command, mode and run they show, and what kind of time their axis is."""

from __future__ import annotations

from pathlib import Path

import pytest

from murmura.server.outputs import RunRecorder, plot_labels


@pytest.mark.parametrize("config,title,virtual", [
    ({"server": {"mode": "async"}, "simulation": {"clients": 9}},
     "murmura simulate: async mode, r1", True),
    ({"server": {"mode": "sync"}, "run": {"clients": 3}}, "murmura run: sync mode, r1", False),
    ({"server": {"mode": "compass"}}, "murmura server: compass mode, r1", False),
    ({"gossip": {"topology": "modest"}, "simulation": {}},
     "murmura simulate: gossip (modest), r1", True),
    ({"gossip": {"topology": "random"}, "run": {}}, "murmura run: gossip (random), r1", False),
])
def test_the_title_names_the_command_mode_and_run(config: dict, title: str,
                                                  virtual: bool) -> None:
    assert plot_labels(config, Path("runs/r1")) == (title, virtual)


def test_a_finished_run_draws_its_plot(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path / "r", config={"server": {"mode": "async"}, "run": {}})
    for v, t in enumerate((12.5, 13.0, 14.0), start=1):  # start-up took 12 s
        rec.record({"version": v, "time_s": t, "accuracy": 0.5 + v / 10, "bytes_up": v * 1000})
    rec.finish()
    assert (tmp_path / "r" / "accuracy.png").stat().st_size > 1000
