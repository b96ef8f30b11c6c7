"""Typed, self-validating configuration of gossip learning (the ``[gossip]`` TOML table)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from murmura.protocols.messages import TaskSettings

TOPOLOGIES = ("epidemic", "ring", "k-regular", "modest")


@dataclass(frozen=True)
class GossipConfig:
    """How peers train, whom they talk to and how they mix what they receive.

    Every peer of a run must use the same values (like a server's task settings): the topology
    decisions are hashes of (``seed``, round, peer id), so peers agree on them without talking.

    * ``topology``: ``epidemic`` (send to ``fanout`` random peers of the view every round,
      ``fanout`` 0 meaning ceil(log2 n)), ``ring``, ``k-regular`` (``degree`` neighbours in
      id order), ``modest`` (a hash-sampled set of trainers and aggregators per round, see
      :mod:`murmura.gossip.modest`; no seed mode).
    * ``rule``: the aggregation rule each peer applies to its neighbours' models (as deltas
      from its own), any name of the aggregation registry; ``sybil`` weights neighbours by
      how dissimilar their histories are, the peer's own model staying at weight 1; peers
      spread sketches of the models they received (``history_share`` per shuffle, at most
      ``history_records`` kept), so clone identities meet in every peer's histories sooner,
      and the collusion screen judges every peer heard of, first-hand or not. With ``sybil``,
      neighbours' trust ramps up over a peer's first ``trust_warmup`` mixings (1/N of it in the
      first, full from the N-th; 0 or 1: no ramp): the screen has no histories to judge by yet,
      and a backdoor mixed in then outlives the attackers being found later (measured on the
      robustness benchmark, docs/robustness.md).
    * ``view_size`` bounds the peer-sampling view; ``shuffle_size`` entries travel per shuffle.
    * ``max_inbox`` bounds the models a peer holds between two mixes (all senders, all
      rounds); a push beyond it is refused (RESOURCE_EXHAUSTED), so invented ids cannot grow
      a peer's memory without limit. 0 (default): twice the most a round can bring (the
      view, degree, fanout or sample size, whichever is largest), at least 64.
    * ``seed_mode`` ("Just One Byte", Zelikman et al. 2023,
      https://arxiv.org/abs/2306.05374): peers train zeroth-order and send their step logs
      (codec ``seed``: a seed and a scalar per step) instead of models; receivers replay them
      bit-exactly on the round's base model and average the updates in peer-id order, so
      peers that start a round from the same model and hear from the same peers end it with
      bit-identical models (k-regular with ``degree`` = n - 1 keeps every peer identical).
      Each peer keeps the step logs of its last ``journal_rounds`` rounds, so a joining peer
      catches up by replaying them on a snapshot (:mod:`murmura.gossip.journal`).
    * ``round_timeout_s``: how long a peer waits for its neighbours' models before mixing what
      it has; ``min_messages`` 0 waits for the expected in-degree (ring, k-regular) or one
      message (epidemic).
    """

    rounds: int = 30
    topology: str = "epidemic"
    fanout: int = 0
    degree: int = 4
    view_size: int = 32
    shuffle_size: int = 8
    rule: str = "fedavg"
    rule_options: dict[str, str] = field(default_factory=dict)
    weight_by_examples: bool = False  # mixing weights: example counts (else equal)
    sybil: bool = False
    history_share: int = 16        # sybil: history records offered per view shuffle...
    history_records: int = 512     # ...and kept per peer (each one sketch of 512 floats)
    trust_warmup: int = 6          # sybil: mixings over which neighbours' trust ramps up
    round_timeout_s: float = 2.0
    min_messages: int = 0
    max_round_lag: int = 10
    max_inbox: int = 0
    require_signatures: bool = False  # refuse messages from peers that do not sign
    min_peers: int = 1             # wait until this many peers (self included) are known...
    start_timeout_s: float = 30.0  # ...or this long, before the first round
    # local training, as a server's [server.train] would say
    lr: float = 0.1
    local_epochs: int = 1
    local_steps: int = 0
    batch_size: int = 16
    momentum: float = 0.5
    seed: int = 0
    # seed mode: zeroth-order training; peers send (seed, scalar) step logs, not models
    seed_mode: bool = False
    zo_eps: float = 1e-3
    journal_rounds: int = 50       # seed mode: rounds of step logs kept for catch-up
    # MoDeST-style sampling (topology 'modest')
    sample_size: int = 10
    aggregators: int = 3

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.fanout < 0 or self.degree < 1:
            raise ValueError("fanout must be >= 0 and degree >= 1")
        if self.view_size < 2 or not 1 <= self.shuffle_size <= self.view_size:
            raise ValueError("need view_size >= 2 and 1 <= shuffle_size <= view_size")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s must be positive, got {self.round_timeout_s}")
        if self.min_peers < 1 or not self.start_timeout_s >= 0:
            raise ValueError("min_peers must be >= 1 and start_timeout_s >= 0")
        if self.max_inbox < 0:
            raise ValueError(f"max_inbox must be >= 0 (0: automatic), got {self.max_inbox}")
        if self.min_messages < 0 or self.max_round_lag < 1:
            raise ValueError("min_messages must be >= 0 and max_round_lag >= 1")
        if self.history_share < 0 or self.history_records < 1:
            raise ValueError("history_share must be >= 0 and history_records >= 1")
        if self.trust_warmup < 0:
            raise ValueError(f"trust_warmup must be >= 0, got {self.trust_warmup}")
        if self.journal_rounds < 1:
            raise ValueError(f"journal_rounds must be >= 1, got {self.journal_rounds}")
        if self.sample_size < 1 or self.aggregators < 1:
            raise ValueError("sample_size and aggregators must be >= 1")
        if self.topology == "modest" and self.seed_mode:
            raise ValueError("topology 'modest' moves aggregated models: it has no seed mode")
        self.settings()  # validates lr, epochs, batch size, momentum

    def settings(self) -> TaskSettings:
        """Local training settings (what a server would send at join)."""
        if self.seed_mode:
            return TaskSettings(trainer="zo", codec="seed", local_epochs=self.local_epochs,
                                local_steps=self.local_steps, batch_size=self.batch_size,
                                lr=self.lr, momentum=0.0, seed=self.seed, zo_eps=self.zo_eps)
        return TaskSettings(trainer="sgd", local_epochs=self.local_epochs,
                            local_steps=self.local_steps, batch_size=self.batch_size, lr=self.lr,
                            momentum=self.momentum, seed=self.seed)

    def inbox_limit(self) -> int:
        """``max_inbox``, or its automatic value."""
        if self.max_inbox:
            return self.max_inbox
        return max(64, 2 * max(self.view_size, self.degree, self.fanout, self.sample_size))

    def fanout_for(self, n: int) -> int:
        """Peers to send to per round: ``fanout``, or ceil(log2 n) (Epidemic Learning's s)."""
        if self.fanout:
            return self.fanout
        return max(1, math.ceil(math.log2(max(n, 2))))


__all__ = ["TOPOLOGIES", "GossipConfig", "PeerConfig"]


@dataclass(frozen=True)
class PeerConfig:
    """One peer process: where it listens, whom it asks first, which data share it holds."""

    listen: str = "127.0.0.1:0"
    bootstrap: str = ""            # HOST:PORT[,HOST:PORT...]; empty for the first peer
    peer_id: str = ""              # default: peer-<client_index>
    client_index: int = 0
    num_clients: int = 1
    device: str = "cpu"
    threads: int = 0
    catch_up: bool = False         # pull the most advanced peer's model first (a late joiner)
    attack: str = ""               # red-team mode, as for clients
    attack_options: dict[str, str] = field(default_factory=dict)
    report: str = ""               # directory for per-round rows (murmura run --gossip)
    key: str = ""                  # identity key FILE (murmura keys new); default: ephemeral
    unsigned: bool = False         # send unsigned messages (peers that predate signatures)

    def __post_init__(self) -> None:
        if ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")
        if any(":" not in b for b in self.bootstrap_list()):
            raise ValueError(f"bootstrap must be HOST:PORT[,HOST:PORT...], got "
                             f"{self.bootstrap[:80]!r}")
        if self.num_clients < 1 or not 0 <= self.client_index < self.num_clients:
            raise ValueError(f"client_index must lie in 0..num_clients-1, got "
                             f"{self.client_index} of {self.num_clients}")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")

    def bootstrap_list(self) -> list[str]:
        return [b.strip() for b in self.bootstrap.split(",") if b.strip()]

    def identity(self) -> str:
        return self.peer_id or f"peer-{self.client_index:03d}"
