"""Simulated and real peers agree: the same tiny configuration gives the same models."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from murmura.gossip import GossipConfig, PeerConfig
from murmura.gossip.process import build_peer
from murmura.simulation.config import SimulationConfig
from murmura.simulation.gossip import GossipSimulation
from murmura.tasks import TaskConfig

pytestmark = pytest.mark.integration


def test_three_real_peers_match_the_simulation_bit_for_bit(one_torch_thread) -> None:
    # k-regular with degree 2 on 3 peers: everyone waits for both others each round, so the
    # real run mixes exactly what the synchronous simulation mixes, in the same order
    task = TaskConfig()
    cfg = GossipConfig(rounds=3, topology="k-regular", degree=2, min_peers=3,
                       round_timeout_s=30.0, local_epochs=1)
    sim = GossipSimulation(task, cfg, SimulationConfig(clients=3, executor="loop"),
                           out_dir=None).run()

    peers = _run_peers(cfg, 3)

    for i, peer in enumerate(peers):
        assert peer.stats.mixed == 6  # both neighbours, every round
        np.testing.assert_array_equal(peer.node.model, sim.models[i])


def _start_peers(cfg: GossipConfig, n: int, peers: list) -> str:  # noqa: ANN001
    """Start ``n`` in-process peers (into ``peers``, for the caller to stop); peer 0's
    address, the others' bootstrap."""
    task = TaskConfig()
    peers.append(build_peer(PeerConfig(client_index=0, num_clients=n), task, cfg))
    first = peers[0].start()
    for i in range(1, n):
        peers.append(build_peer(PeerConfig(client_index=i, num_clients=n, bootstrap=first),
                                task, cfg))
        peers[-1].start()
    return first


def _in_threads(peers: list, target) -> None:  # noqa: ANN001
    threads = [threading.Thread(target=target, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)


def _run_peers(cfg: GossipConfig, n: int) -> list:  # noqa: ANN001
    peers: list = []
    try:
        _start_peers(cfg, n, peers)
        _in_threads(peers, lambda p: p.run())
    finally:
        for p in peers:
            p.stop()
    return peers


def test_seed_mode_peers_send_step_logs_and_hold_bit_identical_models(one_torch_thread) -> None:
    cfg = GossipConfig(rounds=3, topology="k-regular", degree=2, min_peers=3, seed_mode=True,
                       local_steps=20, lr=0.02, round_timeout_s=30.0)
    peers = _run_peers(cfg, 3)

    models = [p.node.model for p in peers]
    for p, m in zip(peers, models, strict=True):
        assert p.stats.mixed == 6 and p.stats.send_failures == 0
        np.testing.assert_array_equal(m, models[0])
    assert not np.array_equal(models[0], peers[0].node.bases[0])  # it trained
    per_round = peers[0].transport.bytes_sent / 3  # step logs, two per round, + shuffles
    assert per_round < 4096, per_round  # a model push alone is 19 kB
    # the simulator's seed mode replays the same logs in the same order: the same models
    sim = GossipSimulation(TaskConfig(), cfg, SimulationConfig(clients=3), out_dir=None).run()
    for i, p in enumerate(peers):
        np.testing.assert_array_equal(sim.models[i], p.node.model)


def test_a_late_seed_mode_peer_catches_up_from_step_logs_alone(one_torch_thread) -> None:
    # three seed-mode peers train three rounds and keep serving; a fourth joins late and
    # rebuilds their model from the run's starting model (which it holds) plus the step logs
    cfg = GossipConfig(rounds=10, topology="k-regular", degree=2, min_peers=3, seed_mode=True,
                       local_steps=20, lr=0.02, round_timeout_s=30.0)
    peers: list = []
    late = None
    try:
        first = _start_peers(cfg, 3, peers)

        def three_rounds(p) -> None:  # noqa: ANN001
            p._await_peers()
            for _ in range(3):
                p.step()

        _in_threads(peers, three_rounds)
        late = build_peer(PeerConfig(client_index=0, num_clients=3, peer_id="late",
                                     bootstrap=first, catch_up=True), TaskConfig(), cfg)
        late.start()  # joins, then catches up

        assert late.node.round == 3
        np.testing.assert_array_equal(late.node.model, peers[0].node.model)
        # 3 rounds x 3 step logs of 20 steps, against 19 kB for one model
        assert 0 < late.stats.catch_up_bytes < late.spec.nbytes / 4
        # it can serve the same catch-up to the next peer: it adopted the journal
        assert late.node.journal is not None and len(late.node.journal.rounds) == 3
    finally:
        for p in [*peers, *([late] if late else [])]:
            p.close()
