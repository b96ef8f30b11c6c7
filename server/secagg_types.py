"""The plain values of a SecAgg+ round, apart from the round's state machine.

:class:`~murmura.server.secagg.SecAggRound` consumes and returns these; the gRPC servicer, the
async policy and the simulator's clients build and read them without needing the state machine
(or its cryptography) itself. Here: the two refusals only secure aggregation raises, the
:class:`Stage` numbers, a client's key advert, what a client is told at each step
(:class:`ClientView`), the round's result, and two small helpers clients and benchmarks use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from murmura.protocols.identity import client_id_for
from murmura.protocols.secagg import default_degree
from murmura.server.errors import ServiceError

__all__ = ["AdvertisedKeys", "AlreadyExists", "ClientView", "NotFound", "PeerView", "Stage",
           "UnmaskResult", "check_identity_of", "round_degree"]


class AlreadyExists(ServiceError):
    """A step the client already took in this round."""

    status = "ALREADY_EXISTS"


class NotFound(ServiceError):
    """A share or envelope naming a client that is not where the request puts it."""

    status = "NOT_FOUND"


class Stage(IntEnum):
    """A round's stages in protocol order (an int, so later stages compare greater)."""

    KEYS = 0
    SHARES = 1
    INPUT = 2
    UNMASK = 3
    DONE = 4
    ABANDONED = 5


@dataclass(frozen=True)
class AdvertisedKeys:
    """What a client advertises in KEYS (``identity_key`` is its join key, or empty)."""

    mask_public_key: bytes
    enc_public_key: bytes
    self_commitment: bytes
    identity_key: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class PeerView:
    """A neighbour as a client sees it at SHARES."""

    index: int
    client_id: str
    keys: AdvertisedKeys


@dataclass(frozen=True)
class ClientView:
    """What :meth:`~murmura.server.secagg.SecAggRound.view` tells one client: enough for its
    next step."""

    round_id: int
    stage: Stage
    index: int = 0
    threshold: int = 0
    n_max: int = 0
    neighbours: tuple[PeerView, ...] = ()
    ciphertexts: tuple[tuple[int, bytes], ...] = ()
    included: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    reason: str = ""
    #: From INPUT on: the factor this client scales its weighted update by (an async group's
    #: staleness discount; 1 in sync rounds).
    factor: float = 1.0
    #: From INPUT on: the fewest inputs the round is unmasked with (distributed DP sizes
    #: each client's noise share by it).
    min_inputs: int = 0


@dataclass(frozen=True)
class UnmaskResult:
    """The round's aggregate: FedAvg's weighted mean, the total weight, how many clients,
    and the weighted sum itself (distributed DP divides it by a planned denominator)."""

    mean: npt.NDArray[np.float32]
    weight: float
    count: int
    total: npt.NDArray[np.float32]


def check_identity_of(client_id: str, identity_key: bytes) -> bool:
    """Whether ``client_id`` is the id derived from ``identity_key`` (clients check this for
    every neighbour, so a server cannot pass one client's keys off as another's)."""
    try:
        return client_id_for(identity_key) == client_id
    except ValueError:
        return False


def round_degree(n: int, dropout_fraction: float) -> int:
    """The neighbour degree a round of ``n`` clients uses (the round makes its graph with it;
    benchmarks report it). ``default_degree`` keeps ``n * k`` even below ``n - 1``, but its
    cap may not, and a regular graph needs it even."""
    k = default_degree(n, dropout_fraction)
    return k - 1 if (n * k) % 2 else k
