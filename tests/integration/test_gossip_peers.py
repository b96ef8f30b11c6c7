"""Real peer processes on loopback: they converge, survive losing half, and take a restarted
peer back. Peers are forked from a forkserver that has imported torch once."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from murmura.gossip import GossipConfig, PeerConfig
from murmura.gossip.process import peer_process
from murmura.protocols.identity import NodeKey
from murmura.tasks import TaskConfig, load_task
from murmura.tasks.models import evaluate

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK = TaskConfig()


class Peers:
    """Starts peer processes and collects their events; kills what is left at teardown."""

    def __init__(self, report: Path) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["murmura.gossip.process", "torch._dynamo"])
        self.events = self.ctx.Queue()
        self.report = report
        self.procs: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}
        self.done: dict[str, tuple[dict[str, Any], np.ndarray, int]] = {}

    def start(self, index: int, n: int, gossip: GossipConfig, bootstrap: str = "", *,
              catch_up: bool = False) -> str:
        # one key file per peer: a restarted peer keeps its id by keeping its key
        key = self.report / f"peer-{index}.key"
        if not key.exists():
            NodeKey.generate().save(key)
        cfg = PeerConfig(client_index=index, num_clients=n, bootstrap=bootstrap, threads=1,
                         report=str(self.report), catch_up=catch_up, key=str(key))
        p = self.ctx.Process(target=peer_process, args=(cfg, TASK, gossip, self.events))
        p.start()
        self.procs[cfg.identity()] = p
        self.wait(lambda: cfg.identity() in self.addresses and p.is_alive(), 60)
        return self.addresses[cfg.identity()]

    def _drain(self, timeout: float) -> None:
        try:
            event = self.events.get(timeout=timeout)
        except Exception:
            return
        if event[0] == "started":
            self.addresses[event[1]] = event[2]
        else:
            self.done[event[1]] = (event[2], event[3], event[4])

    def wait(self, condition: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out waiting for the peers"
            self._drain(0.05)

    def rounds(self, peer: str) -> int:
        path = self.report / f"{peer}.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def kill(self, peer: str) -> None:
        os.kill(self.procs[peer].pid, signal.SIGKILL)
        self.procs[peer].join(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Peers]:
    group = Peers(tmp_path)
    yield group
    group.close()


def _accuracy(model: np.ndarray) -> float:
    task = load_task(TASK)
    module = task.build_model()
    from murmura.protocols import ModelSpec

    ModelSpec.from_module(module).load_into(module, model)
    return evaluate(module, task.test)["accuracy"]


def _distance(models: list[np.ndarray]) -> float:
    """Consensus distance relative to the mean model's norm."""
    stack = np.stack(models).astype(np.float64)
    mean = stack.mean(0)
    return float(np.sqrt(((stack - mean) ** 2).sum(1).mean()) / np.linalg.norm(mean))


def test_five_peer_processes_converge(peers: Peers) -> None:
    gossip = GossipConfig(rounds=20, min_peers=5, round_timeout_s=1.0)
    first = peers.start(0, 5, gossip)
    for i in range(1, 5):
        peers.start(i, 5, gossip, first)

    peers.wait(lambda: len(peers.done) == 5, 120)

    models = [m for _, m, _ in peers.done.values()]
    accs = [_accuracy(m) for m in models]
    # from 0.1 at the start; non-IID peers' own models after a round of local training. Five
    # processes share 2 cores: a peer that stalls falls behind, then jumps to the others'
    # round and mixes fewer rounds (CI saw one run 16 of 20 rounds: mean 0.849, min 0.827),
    # so the mean bound is the churn test's 0.8
    assert np.mean(accs) > 0.8 and min(accs) > 0.75, accs
    assert _distance(models) < 0.2
    for peer, (stats, _, _) in peers.done.items():
        last = json.loads((peers.report / f"{peer}.jsonl").read_text().splitlines()[-1])
        assert last["round"] == 19 and stats["received"] > 0  # a slow peer may skip rounds


def test_killing_half_leaves_the_rest_converging_and_a_restarted_peer_rejoins(
        peers: Peers) -> None:
    # min_messages above what any peer can receive makes every round last round_timeout_s:
    # the survivors then run for about 25 s after the kill, well past the restarted peer's
    # start-up (8 s seen in CI under load), so there is someone left to take it back
    gossip = GossipConfig(rounds=30, min_peers=6, round_timeout_s=1.0, min_messages=6)
    first = peers.start(0, 6, gossip)
    for i in range(1, 6):
        peers.start(i, 6, gossip, first)
    peers.wait(lambda: min(peers.rounds(f"peer-00{i}") for i in range(6)) >= 5, 60)

    for i in (0, 2, 4):  # the bootstrap peer among them
        peers.kill(f"peer-00{i}")
    survivor = peers.addresses["peer-001"]
    peers.start(2, 6, gossip, survivor, catch_up=True)  # restarted: same id, new port

    peers.wait(lambda: {"peer-001", "peer-002", "peer-003", "peer-005"} <= set(peers.done), 120)
    finished = {p: peers.done[p] for p in ("peer-001", "peer-003", "peer-005", "peer-002")}
    accs = {peer: _accuracy(model) for peer, (_, model, _) in finished.items()}
    # from 0.1 at the start; as in the 5-peer test, a peer's own model after its last local
    # round on non-IID data may sit a few points below the others (a CI run saw 0.76)
    assert all(stats["rounds"] > 0 for stats, _, _ in finished.values())
    assert np.mean(list(accs.values())) > 0.8 and min(accs.values()) > 0.7, accs
    restarted_stats, _, first_round = finished["peer-002"]
    assert first_round >= 5  # caught up from a survivor's model and round
    assert restarted_stats["received"] > 0  # the survivors took it back
    assert all(finished[p][0]["send_failures"] > 0 for p in ("peer-001", "peer-003",
                                                             "peer-005"))
    assert _distance([m for _, m, _ in finished.values()]) < 0.2
