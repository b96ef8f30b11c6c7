"""What a leaf writes: one metrics row per partial it forwarded and a summary of them (partials
sent, updates folded, clients, bytes), never a claim to versions or accuracy it did not make."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from murmura.server import ServerThread, build_core
from murmura.server.leaf import Leaf
from tests.integration.test_leaf import (
    TASK,
    VERSIONS,
    leaf_config,
    leaf_keys,
    run_clients,
    top_config,
)

pytestmark = pytest.mark.integration


def test_a_leaf_writes_its_own_summary_and_rows(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    keys = tmp_path / "keys"
    core = build_core(top_config("float32", 1, leaf_keys(keys, "site-a")), TASK, out_dir=None,
                      evaluate=False)
    out = tmp_path / "site-a"
    servers: list[ServerThread] = []
    with caplog.at_level(logging.INFO, logger="murmura.server"):
        try:
            top = ServerThread(core, "127.0.0.1:0").start()
            servers.append(top)
            leaf = Leaf(leaf_config(top.address, "site-a", "float32", keys), TASK, out_dir=out)
            servers.append(ServerThread(leaf).start())
            threads = run_clients([leaf.address] * 2)
            assert top.wait_done(timeout=120)
            for th in threads:
                th.join(30)
        finally:
            for srv in reversed(servers):
                srv.stop(grace=None)
    summary = leaf.finish(wall_s=1.0)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["role"] == "leaf" and summary["name"] == "site-a"
    assert "versions" not in summary and "final_accuracy" not in summary
    assert summary["partials_sent"] == VERSIONS  # one partial per round of the top
    assert summary["updates_folded"] == 2 * VERSIONS and summary["clients"] == 2
    assert summary["partial_bytes_sent"] > 0 and summary["bytes_up"] > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["partial"] for r in rows] == list(range(1, summary["partials_made"] + 1))
    assert [r["updates_in_partial"] for r in rows][:VERSIONS] == [2] * VERSIONS
    assert all("accuracy" not in r and "version" not in r for r in rows)
    # the top logs the link's join as a re-join of the id that read the settings, not a
    # second leaf
    joins = [r.getMessage() for r in caplog.records
             if r.name == "murmura.server.sessions" and "joined" in r.getMessage()
             and leaf.identity.client_id in r.getMessage()]
    assert len(joins) == 2 and "joined again" in joins[1], joins
