"""The virtual clients' own codec: a fixed one, or ``auto`` (each client picks from its link
speed after its first push, by the client runtime's own rule, ``rules.auto_switch``)."""

from __future__ import annotations

import pytest

from murmura.client.rules import auto_switch
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import SimulationConfig, simulate
from murmura.tasks import TaskConfig

TASK = TaskConfig(task="digits")
SERVER = ServerConfig.from_flat(max_versions=3, seed=2, require_identity=False,
                                train=TaskSettings(local_epochs=1, batch_size=32))


def per_update_bytes(rows: list[dict]) -> list[float]:
    out, before_b, before_u = [], 0, 0
    for r in rows:
        out.append((r["bytes_up"] - before_b) / max(r["updates"] - before_u, 1))
        before_b, before_u = r["bytes_up"], r["updates"]
    return out


def test_auto_switches_slow_links_to_a_smaller_codec_after_the_first_push() -> None:
    slow = simulate(TASK, SERVER, SimulationConfig(clients=4, client_codec="auto",
                                                   uplink_mbps=0.05, workers=1), out_dir=None)
    sizes = per_update_bytes(slow.rows)
    assert sizes[1] < sizes[0] / 3  # dense first, then int8 or top-k
    fast = simulate(TASK, SERVER, SimulationConfig(clients=4, client_codec="auto",
                                                   uplink_mbps=1000.0, workers=1), out_dir=None)
    sizes = per_update_bytes(fast.rows)
    assert sizes[1] == pytest.approx(sizes[0], rel=0.01)  # dense fits the budget: kept


def test_the_rule_is_the_client_runtimes() -> None:
    # 1 MB took 1 s after 2 s of training: only top-k (2 %) fits 10 % of the training time
    assert auto_switch(1_000_000, 1_000_000, 1.0, 2.0, "dense-f32") == ("topk",
                                                                       {"ratio": "0.01"})
    assert auto_switch(1_000_000, 1_000_000, 0.01, 2.0, "dense-f32") is None
    assert auto_switch(1_000_000, 1_000_000, 0.0, 2.0, "dense-f32") is None


def test_a_fixed_client_codec_is_used_by_every_client() -> None:
    result = simulate(TASK, SERVER, SimulationConfig(clients=3, client_codec="int8", workers=1),
                      out_dir=None)
    dense = simulate(TASK, SERVER, SimulationConfig(clients=3, workers=1), out_dir=None)
    assert per_update_bytes(result.rows)[0] < per_update_bytes(dense.rows)[0] / 3
    with pytest.raises(ValueError, match="client_codec"):
        SimulationConfig(client_codec="zip")
