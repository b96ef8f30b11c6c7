"""Plain Python types for what travels on the wire.

Servicers and transports convert between these and the generated ``*_pb2`` messages (see
:mod:`murmura.protocols.serde`); the rest of Murmura sees only these types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from murmura.protocols.secagg.weighted import SecAggParams

#: 2: updates are signed over every header field (identity.signed_update_message); a client
#: of protocol 1 signs fewer fields, so it is refused at Join with a clear reason.
PROTOCOL_VERSION = 2


@dataclass(frozen=True)
class DeviceProfile:
    """What a client says about the hardware it trains on."""

    device: str = "cpu"
    device_name: str = ""
    memory_bytes: int = 0
    steps_per_s: float = 0.0
    cpu_count: int = 0
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSettings:
    """How clients train locally and encode their updates; chosen by the server."""

    trainer: str = "sgd"
    local_epochs: int = 3
    local_steps: int = 0
    batch_size: int = 16
    lr: float = 0.1
    momentum: float = 0.5
    codec: str = "dense-f32"
    codec_options: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    zo_eps: float = 1e-3
    #: Clients evaluate the global model they pull on their local test split once every this
    #: many versions and report it with their next update (0: never; docs/apps.md).
    client_eval_every: int = field(default=0, metadata={"help": (
        "clients evaluate the global model on their local test split every N versions; the "
        "weighted mean, min and max go into metrics.jsonl (default: 0, never)")})

    def __post_init__(self) -> None:
        if self.client_eval_every < 0:
            raise ValueError(f"client_eval_every must be >= 0 (0: never), got "
                             f"{self.client_eval_every}")
        if not self.zo_eps > 0:
            raise ValueError(f"zo_eps must be positive, got {self.zo_eps}")
        if self.trainer not in ("sgd", "zo"):
            raise ValueError(f"trainer must be 'sgd' or 'zo', got {self.trainer!r}")
        if self.codec == "seed" and self.trainer != "zo":
            raise ValueError("codec 'seed' carries zeroth-order steps: use it with trainer='zo'")
        if self.local_epochs < 0 or self.local_steps < 0:
            raise ValueError("local_epochs and local_steps must be >= 0")
        if self.local_epochs == 0 and self.local_steps == 0:
            raise ValueError("set local_epochs or local_steps to a positive number")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum}")


class Action(enum.IntEnum):
    WAIT = 0
    TRAIN = 1
    STOP = 2


@dataclass(frozen=True)
class Task:
    """The server's answer to "what should I do next"."""

    action: Action
    version: int = 0
    round: int = 0
    retry_after_s: float = 0.0
    seed: int = 0
    #: Local steps the server assigns for this task (computing-power-aware scheduling);
    #: 0 means the join settings' own ``local_steps``/``local_epochs``.
    local_steps: int = 0


@dataclass(frozen=True)
class UpdateHeader:
    """Everything about an update except its payload bytes."""

    session: str
    update_id: str
    base_version: int
    num_examples: int
    codec: str
    payload_bytes: int
    round: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    spec_fingerprint: str = ""
    #: The sender's Ed25519 signature of ``identity.signed_update_message``, which covers every
    #: other field here and the payload's SHA-256 (empty: unsigned).
    signature: bytes = b""


@dataclass(frozen=True)
class JoinProof:
    """A node's proof that it holds the key its client id is derived from: its public key,
    the server's challenge nonce, and its signature of ``identity.join_message``."""

    public_key: bytes
    nonce: bytes
    signature: bytes


@dataclass(frozen=True)
class PushResult:
    duplicate: bool
    version: int
    staleness: int


@dataclass(frozen=True)
class JoinResult:
    session: str
    settings: TaskSettings
    mode: str
    max_payload_bytes: int
    #: The run's secure-aggregation encoding, None when the run does not use it.
    secagg: SecAggParams | None = None
    #: Non-zero: the port (on the aggregator's host) whose receiver processes take pushes.
    push_port: int = 0


# -- gossip mode ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerInfo:
    """A peer as another peer's view knows it: id, serving address, freshness."""

    peer_id: str
    address: str
    round: int = 0
    age: int = 0
    public_key: bytes = b""  # a signing peer's Ed25519 key (first-hand messages are checked)


@dataclass(frozen=True)
class PeerModelHeader:
    """Everything about a peer-to-peer model push except its payload bytes."""

    sender: PeerInfo
    message_id: str
    round: int
    num_examples: int
    codec: str
    payload_bytes: int
    spec_fingerprint: str = ""
    signature: bytes = b""
    kind: str = ""  # "" a model to mix; MoDeST rounds: "trained" or "aggregate"
