"""Gossip mode: peers that train together with no server (docs/gossip.md)."""

from murmura.gossip.config import TOPOLOGIES, GossipConfig, PeerConfig
from murmura.gossip.errors import (
    FailedPrecondition,
    GossipError,
    InvalidArgument,
    PermissionDenied,
)
from murmura.gossip.identity import AddressBinding
from murmura.gossip.mixing import mix
from murmura.gossip.node import PeerNode, training_seed
from murmura.gossip.runtime import PeerRuntime, PeerStats, RoundReport
from murmura.gossip.topology import (
    epidemic_targets,
    k_regular_targets,
    modest_sample,
    ring_targets,
    targets,
)
from murmura.gossip.transport import GrpcPeerTransport, Health, PeerHandler, PeerTransport
from murmura.gossip.view import PeerView

__all__ = [
    "TOPOLOGIES",
    "AddressBinding",
    "FailedPrecondition",
    "GossipConfig",
    "PeerConfig",
    "GossipError",
    "GrpcPeerTransport",
    "Health",
    "InvalidArgument",
    "PeerHandler",
    "PeerNode",
    "PeerRuntime",
    "PeerStats",
    "PeerTransport",
    "PeerView",
    "PermissionDenied",
    "RoundReport",
    "epidemic_targets",
    "k_regular_targets",
    "mix",
    "modest_sample",
    "ring_targets",
    "targets",
    "training_seed",
]
