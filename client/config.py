"""Typed configuration of a client process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the parser reads this module without torch
    from murmura.protocols.identity import NodeKey
    from murmura.protocols.tls import ClientTls

#: ``murmura client --trainer``: how the client picks first- or zeroth-order training.
CLIENT_TRAINERS = ("auto", "server", "zo")


@dataclass(frozen=True)
class ClientConfig:
    """Where the aggregator is, who this client is, and what it trains on."""

    server: str = "127.0.0.1:50051"
    client_id: str = field(default="", metadata={"help": (
        "legacy: join unsigned under this id (only a server with require_identity off takes "
        "it); by default the id derives from the client's key")})
    key: str = field(default="", metadata={"help": (
        "identity key FILE from `murmura keys new` (default: a new ephemeral key per run)")})
    tls_ca: str = field(default="", metadata={"help": (
        "CA certificate (PEM) that signed the server's certificate: connect with TLS")})
    tls_cert: str = field(default="", metadata={"help": (
        "this client's certificate (PEM) for a server that requires mutual TLS")})
    tls_key: str = field(default="", metadata={"help": "the private key of --tls-cert (PEM)"})
    insecure: bool = field(default=False, metadata={"help": (
        "allow plaintext to a non-loopback server (default: refused)")})
    device: str = "auto"
    codec: str = ""                # default: the server's choice; auto: from the link speed
    token: str = ""
    client_index: int = 0          # which share of the bundled task's data this client holds
    num_clients: int = 1           # how many shares the data is split into
    max_tasks: int = 0             # 0: until the server says stop
    wait_s: float = 10.0
    threads: int = 0               # torch intra-op threads; 0 leaves torch's default
    amp: str = "auto"              # mixed precision: auto (bf16/fp16 on CUDA), off, bf16, fp16
    profile: bool = True           # measure training speed at start and send it with Join
    memory_fraction: float = 0.0   # CUDA: cap this process at this share of the GPU (0: none)
    micro_batch: int = 0           # rows per pass (gradient accumulation); 0: probe on CUDA
    cuda_graph: bool = False       # CUDA: replay first-order steps as a captured CUDA graph
    status_file: str = ""          # write progress JSON here after every task (murmura launch)
    give_up_after_s: float = 300.0
    give_up_unreached_s: float = 30.0
    attack: str = ""               # opt-in malicious mode (tests, red-team runs)
    attack_options: dict[str, str] = field(default_factory=dict)
    ack_log: str = ""              # append one JSON line per acknowledged update to this file
    trainer: str = field(default="auto", metadata={"help": (
        "auto: the server's choice, but zeroth-order where one example's backward pass does "
        "not fit the device's memory (probed on CUDA); server: the server's choice always; "
        "zo: zeroth-order always (forward passes only)")})
    zo_lr: float = field(default=0.005, metadata={"help": (
        "step size of this client's zeroth-order steps when it trains zeroth-order under a "
        "first-order server (--trainer auto or zo)")})
    secure_aggregation: bool = field(default=False, metadata={"help": (
        "insist on secure aggregation: refuse to train for a server that does not run it, "
        "so this client's updates never leave it unmasked (docs/privacy.md). Without the "
        "flag the client follows the server either way")})

    def __post_init__(self) -> None:
        if ":" not in self.server:
            raise ValueError(f"server must be HOST:PORT, got {self.server!r}")
        from murmura.edge import DEVICES

        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or cuda:N, got {self.device!r}")
        if self.num_clients < 1 or not 0 <= self.client_index < self.num_clients:
            raise ValueError(f"client_index must lie in 0..num_clients-1, got "
                             f"{self.client_index} of {self.num_clients}")
        from murmura.client.malicious import make_attack

        make_attack(self.attack, self.attack_options)  # fails now on a bad name or option
        from murmura.edge import AMP_MODES

        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {AMP_MODES}, got {self.amp!r}")
        if self.trainer not in CLIENT_TRAINERS:
            raise ValueError(f"trainer must be one of {CLIENT_TRAINERS}, got "
                             f"{self.trainer[:20]!r}")
        if not 0 < self.zo_lr < float("inf"):
            raise ValueError(f"zo_lr must be a positive number, got {self.zo_lr}")
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0, got {self.micro_batch}")
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must lie in [0, 1] (0: no cap), got "
                             f"{self.memory_fraction}")
        if self.max_tasks < 0 or self.wait_s < 0 or self.threads < 0:
            raise ValueError("max_tasks, wait_s and threads must be >= 0")
        if self.key and self.client_id:
            raise ValueError("give --key or --client-id, not both: a key's client id derives "
                             "from the key")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a client certificate needs its key: give both --tls-cert and "
                             "--tls-key")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("--tls-cert (mutual TLS) needs --tls-ca too")
        from murmura.protocols.tls import is_loopback

        if not self.tls_ca and not self.insecure and not is_loopback(self.server):
            raise ValueError(f"refusing to talk plaintext to {self.server[:60]}: give --tls-ca "
                             f"(see docs/security.md) or --insecure")

    def tls(self) -> ClientTls | None:
        """The TLS settings of the link to the server (None: plaintext)."""
        from murmura.protocols.tls import ClientTls

        return ClientTls(self.tls_ca, self.tls_cert, self.tls_key) if self.tls_ca else None

    def node_key(self) -> NodeKey | None:
        """The key this client proves and signs with: ``key``'s file, a fresh one, or None
        for a legacy unsigned ``client_id``."""
        from murmura.protocols.identity import NodeKey

        if self.key:
            return NodeKey.load(self.key)
        return None if self.client_id else NodeKey.generate()
