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

    peers = [build_peer(PeerConfig(client_index=0, num_clients=3), task, cfg)]
    try:
        first = peers[0].start()
        for i in (1, 2):
            peers.append(build_peer(PeerConfig(client_index=i, num_clients=3, bootstrap=first),
                                    task, cfg))
            peers[-1].start()
        threads = [threading.Thread(target=p.run) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    finally:
        for p in peers:
            p.stop()

    for i, peer in enumerate(peers):
        assert peer.stats.mixed == 6  # both neighbours, every round
        np.testing.assert_array_equal(peer.node.model, sim.models[i])
