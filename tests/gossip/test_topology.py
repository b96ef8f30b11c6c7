"""Topology decisions: deterministic, agreed by every peer, shaped as each paper says."""

from __future__ import annotations

import math

import pytest

from murmura.gossip import (
    GossipConfig,
    epidemic_targets,
    k_regular_targets,
    modest_sample,
    ring_targets,
)
from murmura.gossip.topology import expected_senders

IDS = [f"peer-{i:03d}" for i in range(20)]


def test_epidemic_sends_to_s_distinct_others_and_is_reproducible() -> None:
    targets = epidemic_targets("peer-003", 7, IDS, 5, seed=1)

    assert len(targets) == len(set(targets)) == 5
    assert "peer-003" not in targets
    assert targets == epidemic_targets("peer-003", 7, list(reversed(IDS)), 5, seed=1)
    assert targets != epidemic_targets("peer-003", 8, IDS, 5, seed=1)  # fresh every round


def test_epidemic_fanout_defaults_to_ceil_log2_n() -> None:
    assert GossipConfig().fanout_for(100) == math.ceil(math.log2(100)) == 7
    assert GossipConfig().fanout_for(1000) == 10
    assert GossipConfig(fanout=3).fanout_for(1000) == 3


def test_ring_and_k_regular_give_every_peer_the_stated_degree() -> None:
    assert ring_targets("peer-019", IDS) == ["peer-000"]
    for peer in IDS:
        assert len(k_regular_targets(peer, IDS, 4)) == 4
        # undirected lattice: everyone I send to sends to me
        assert all(peer in k_regular_targets(t, IDS, 4) for t in k_regular_targets(peer, IDS, 4))
        others = [p for p in IDS if p != peer]  # a peer's view never holds itself
        assert expected_senders("k-regular", peer, others, degree=4) == 4


def test_modest_sample_is_the_same_whatever_order_peers_know_members_in() -> None:
    a = modest_sample(3, IDS, 5, seed=2)
    b = modest_sample(3, list(reversed(IDS)), 5, seed=2)

    assert a == b and len(a) == 5
    assert modest_sample(3, IDS, 5, seed=2, role="aggregate") != a


def test_unknown_topology_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="topology must be one of"):
        GossipConfig(topology="star")
