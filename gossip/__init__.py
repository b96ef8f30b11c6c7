"""Gossip mode: peers that train together with no server (docs/gossip.md)."""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
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

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "TOPOLOGIES": "murmura.gossip.config",
    "GossipConfig": "murmura.gossip.config",
    "PeerConfig": "murmura.gossip.config",
    "FailedPrecondition": "murmura.gossip.errors",
    "GossipError": "murmura.gossip.errors",
    "InvalidArgument": "murmura.gossip.errors",
    "PermissionDenied": "murmura.gossip.errors",
    "AddressBinding": "murmura.gossip.identity",
    "mix": "murmura.gossip.mixing",
    "PeerNode": "murmura.gossip.node",
    "training_seed": "murmura.gossip.node",
    "PeerRuntime": "murmura.gossip.runtime",
    "PeerStats": "murmura.gossip.runtime",
    "RoundReport": "murmura.gossip.runtime",
    "epidemic_targets": "murmura.gossip.topology",
    "k_regular_targets": "murmura.gossip.topology",
    "modest_sample": "murmura.gossip.topology",
    "ring_targets": "murmura.gossip.topology",
    "targets": "murmura.gossip.topology",
    "GrpcPeerTransport": "murmura.gossip.transport",
    "Health": "murmura.gossip.transport",
    "PeerHandler": "murmura.gossip.transport",
    "PeerTransport": "murmura.gossip.transport",
    "PeerView": "murmura.gossip.view",
}

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


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
