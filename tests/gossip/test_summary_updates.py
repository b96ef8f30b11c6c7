"""Gossip runs count the whole run's updates in summary.json (the last row's ``updates`` is
the running total, like ``bytes_up``); each row keeps its round's in ``updates_in_round``."""

from __future__ import annotations

import json
from pathlib import Path

from murmura.gossip import GossipConfig
from murmura.peers import GossipRun
from murmura.simulation.config import SimulationConfig
from murmura.simulation.gossip import GossipSimulation
from murmura.tasks import TaskConfig


def test_simulated_gossip_summary_counts_every_round(tmp_path: Path) -> None:
    sim = SimulationConfig(clients=8, executor="vmap")
    result = GossipSimulation(TaskConfig(), GossipConfig(rounds=3, local_epochs=1), sim,
                              out_dir=tmp_path).run()
    per_round = [r["updates_in_round"] for r in result.rows]
    assert len(per_round) == 3 and all(n > 0 for n in per_round)
    assert [r["updates"] for r in result.rows] == [sum(per_round[:i + 1]) for i in range(3)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["updates"] == result.summary["updates"] == sum(per_round)


def test_run_gossip_rows_accumulate_the_peers_reports(tmp_path: Path) -> None:
    peers = ["peer-000", "peer-001"]
    for i, p in enumerate(peers):
        lines = [json.dumps({"round": r, "accuracy": 0.5, "loss": 1.0, "mixed": 2 + i,
                             "bytes_sent": 100 * (r + 1), "time_s": float(r)})
                 for r in range(3)]
        (tmp_path / f"{p}.jsonl").write_text("".join(ln + "\n" for ln in lines))
    run = GossipRun(tmp_path, peers)
    run.poll()
    rows = run.complete(set(peers))
    assert [r["updates_in_round"] for r in rows] == [5, 5, 5]
    assert [r["updates"] for r in rows] == [5, 10, 15]  # the summary reads the last row
