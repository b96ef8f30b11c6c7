"""The sections of :class:`~murmura.server.config.ServerConfig`, one frozen dataclass per
concern, each checking its own fields: :class:`PolicyConfig` (when versions are made and how
updates are combined), :class:`TierConfig` (where updates are decoded), :class:`SecurityConfig`
(who may join and push, over what, and how much), :class:`LeafConfig` (a leaf aggregator's place
in a hierarchy) and :class:`PrivacyConfig` (differential privacy and secure aggregation).

What spans sections is checked by ``ServerConfig`` itself (server/config.py), which re-exports
these names.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from murmura.protocols.options import parse_options
from murmura.server.compass import COMPASS_STEPS

if TYPE_CHECKING:  # the rules and codecs load torch: imported where a config is checked, so
    from murmura.aggregation import Aggregator  # the command-line parser can read this module
    from murmura.protocols.secagg.weighted import SecAggParams

STALENESS = ("constant", "polynomial", "hinge")
ACCUMULATORS = ("float32", "exact")
BACKENDS = ("process", "ray")
#: auto: fold in the workers when the rule folds update by update and the model is large
#: enough to be worth a job; on: whenever the rule allows (tests); off: on the publisher.
WORKER_FOLDS = ("auto", "on", "off")
ROLES = ("top", "leaf")


@dataclass(frozen=True)
class PolicyConfig:
    """When versions are made, and how the updates in one are combined.

    Sync rounds run over a cohort; async (FedBuff) applies a step every ``buffer_size``
    updates; compass (FedCompass) gives each client between ``compass_min_steps`` and
    ``compass_max_steps`` local steps from its measured speed so that groups of clients arrive
    together, and makes one version per group. All refuse updates more than ``max_staleness``
    versions old. Which of these applies is the run's ``mode`` (:class:`ServerConfig`).
    """

    # sync rounds
    cohort_size: int = 0           # 0: use cohort_fraction of the joined clients
    cohort_fraction: float = 1.0
    min_clients: int = 2
    round_deadline_s: float = 120.0
    liveness_factor: float = 1.5   # a cohort member silent this x its task time leaves (0: off)
    # async (FedBuff)
    # K = 10 updates per version (FedBuff, https://arxiv.org/abs/2106.06639): the K of every
    # async accuracy benchmark here, so also the N that FedCompass's default step sqrt(m/N)
    # was tuned with. A version is the mean of K clients' updates; with non-IID clients a
    # small K is a biased sample of the label mix, so the model moves towards whoever arrived.
    # On the README's federation.toml (10 Dirichlet-0.5 clients) K = 5 ended 2.0 points below
    # sync (mean of 3 seeds) and K = 10, about one update per client per version, 0.6 points
    # (docs/architecture.md, "Policies", has the runs and what K = 10 costs elsewhere).
    buffer_size: int = 10
    max_staleness: int = 20
    staleness: str = "polynomial"
    staleness_exponent: float = 0.5
    # compass (FedCompass): local steps per task from each client's measured speed
    compass_max_steps: int = 0     # 0: train.local_steps
    compass_min_steps: int = 0     # 0: a fifth of the maximum (at least 1)
    compass_latest_factor: float = 1.5  # a group is aggregated by this x its planned duration
    compass_max_group: int = 0     # most members per group (0: no limit)
    compass_step: str = "sqrt"     # a version's step in means of its updates (COMPASS_STEPS;
                                   # N = compass_reference)
    compass_step_updates: int = 0  # N of compass_step (0: buffer_size)
    # aggregation
    defense: str = "fedavg"        # aggregation rule: fedavg (none) or a robust rule
    defense_options: dict[str, str] = field(default_factory=dict)  # e.g. f=2, trim=0.2
    optimizer: str = "fedavg"
    server_lr: float = 1.0
    accumulator: str = "float32"   # float32 (fast) or exact (order-independent, bit-identical)

    def __post_init__(self) -> None:
        if self.cohort_size < 0:
            raise ValueError(f"cohort_size must be >= 0, got {self.cohort_size}")
        if not 0 < self.cohort_fraction <= 1:
            raise ValueError(f"cohort_fraction must lie in (0, 1], got {self.cohort_fraction}")
        if self.min_clients < 1:
            raise ValueError(f"min_clients must be >= 1, got {self.min_clients}")
        if self.cohort_size and self.cohort_size < self.min_clients:
            raise ValueError(f"cohort_size {self.cohort_size} is below min_clients "
                             f"{self.min_clients}; no round could ever start")
        if not (self.liveness_factor == 0 or 1 <= self.liveness_factor < math.inf):
            raise ValueError(f"liveness_factor must be 0 (off) or at least 1, got "
                             f"{self.liveness_factor}")
        if not self.round_deadline_s > 0:
            raise ValueError(f"round_deadline_s must be positive, got {self.round_deadline_s}")
        if self.buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {self.buffer_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.staleness not in STALENESS:
            raise ValueError(f"staleness must be one of {STALENESS}, got {self.staleness!r}")
        if self.compass_step not in COMPASS_STEPS:
            raise ValueError(f"compass_step must be one of {COMPASS_STEPS}, got "
                             f"{self.compass_step!r}")
        if self.compass_step_updates < 0:
            raise ValueError(f"compass_step_updates must be >= 0 (0: buffer_size, "
                             f"{self.buffer_size}), got {self.compass_step_updates}")
        from murmura.aggregation import available_optimizers

        probe = self._probe()
        if self.optimizer not in available_optimizers():
            raise ValueError(f"unknown optimizer {self.optimizer!r}; "
                             f"available: {', '.join(available_optimizers())}")
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be positive, got {self.server_lr}")
        if self.accumulator not in ACCUMULATORS:
            raise ValueError(f"accumulator must be one of {ACCUMULATORS}, got "
                             f"{self.accumulator!r}")
        if self.accumulator == "exact" and not getattr(probe, "decomposable", False):
            raise ValueError(f"accumulator 'exact' needs a decomposable rule (fedavg); defense "
                             f"{self.defense!r} aggregates the whole buffer")

    def _probe(self) -> Aggregator:
        """One small instance of the rule, so that bad options fail now, not at the first
        round."""
        from murmura.aggregation import AggregationError, available_aggregators, create_aggregator

        if self.defense not in available_aggregators():
            raise ValueError(f"unknown defense {self.defense!r}; "
                             f"available: {', '.join(available_aggregators())}")
        kwargs = self.defense_kwargs()
        if self.defense == "default" and "head" in kwargs:  # a count of the model's values,
            head = kwargs.pop("head")                        # which the probe's 16 lack
            if not (isinstance(head, int) and head >= 0):
                raise ValueError(f"defense 'default': head must be a whole number of values "
                                 f">= 0, got {head!r}")
        try:
            return create_aggregator(self.defense, 16, **kwargs)
        except (AggregationError, TypeError) as exc:
            raise ValueError(f"defense {self.defense!r}: {exc}") from None

    @property
    def decomposable(self) -> bool:
        """Whether the rule folds update by update, so that a sum of partial aggregates is
        the aggregate (a leaf's partials, the exact accumulator)."""
        return bool(getattr(self._probe(), "decomposable", False))

    @property
    def compass_reference(self) -> int:
        """N of ``compass_step``: ``compass_step_updates``, else ``buffer_size``."""
        return self.compass_step_updates or self.buffer_size

    def defense_kwargs(self) -> dict[str, Any]:
        """``defense_options`` with numbers parsed (``none`` means None)."""
        return parse_options(self.defense_options)


@dataclass(frozen=True)
class TierConfig:
    """The serverless aggregation tier: where updates are decoded, and how much may wait."""

    workers: int = -1              # -1: worker processes, 0..max_workers; 0: in-process; N: 0..N
    max_workers: int = 0           # 0: cores - 1 (at least 1)
    worker_idle_s: float = 10.0    # a worker idle this long stops
    max_queue: int = 64            # updates waiting for a worker before pushes are refused
    slab_mb: float = 2048.0        # shared memory for payloads and decoded updates in flight
    backend: str = "process"       # process (local worker processes) or ray
    ray_address: str = ""          # backend ray: a cluster address; empty starts a local Ray
    worker_folds: str = "auto"     # fold accepted updates in the workers (server/folds.py)
    receivers: int = 0             # processes that receive pushes on push_port (0: the gateway)
    push_port: int = 0             # the receivers' port on the server's host (0: any free one)

    def __post_init__(self) -> None:
        if self.worker_folds not in WORKER_FOLDS:
            raise ValueError(f"worker_folds must be one of {WORKER_FOLDS}, got "
                             f"{self.worker_folds!r}")
        if self.workers < -1:
            raise ValueError(f"workers must be -1 (autoscaled worker processes), 0 (decode "
                             f"in-process) or N > 0 (at most N workers), got {self.workers}")
        if self.max_workers < 0:
            raise ValueError(f"max_workers must be >= 0 (0: cores - 1), got {self.max_workers}")
        if not self.worker_idle_s > 0:
            raise ValueError(f"worker_idle_s must be positive, got {self.worker_idle_s}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not self.slab_mb > 0:
            raise ValueError(f"slab_mb must be positive, got {self.slab_mb}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "ray" and self.workers != 0 \
                and importlib.util.find_spec("ray") is None:
            raise ValueError('backend \'ray\': Ray is not installed: pip install "murmura[ray]"')
        if self.ray_address and self.backend != "ray":
            raise ValueError("ray_address is only for backend 'ray'")
        if self.receivers < 0:
            raise ValueError(f"receivers must be >= 0 (0: the gateway receives pushes), got "
                             f"{self.receivers}")
        if self.receivers and self.workers == 0:
            raise ValueError("receivers write payloads into the tier's shared memory, which "
                             "exists only with worker processes: set workers to -1 or N > 0, "
                             "or receivers to 0")
        if not 0 <= self.push_port <= 65535:
            raise ValueError(f"push_port must be a TCP port (0: any free one), got "
                             f"{self.push_port}")
        if self.push_port and not self.receivers:
            raise ValueError("push_port is the receivers' port: set receivers > 0 as well")

    @property
    def worker_limit(self) -> int:
        """The most aggregation worker processes: ``workers`` if positive, else
        ``max_workers``, else cores − 1 (at least 1)."""
        if self.workers > 0:
            return self.workers
        return self.max_workers or max((os.cpu_count() or 2) - 1, 1)


@dataclass(frozen=True)
class SecurityConfig:
    """Who may join and push (identities, keys, a token), over what (TLS), and how much
    (payload size, sessions, rates); docs/security.md."""

    require_identity: bool = field(default=True, metadata={"help": (
        "clients must prove an Ed25519 key at Join and sign every update (default: on; only "
        "the in-memory simulator and old tests turn it off)")})
    allowed_keys: str = field(default="", metadata={"help": (
        "FILE of client public keys (hex, one a line, from `murmura keys new`); others are "
        "refused")})
    leaf_keys: str = field(default="", metadata={"help": (
        "FILE of the public keys of leaf aggregators (hex, one a line: each leaf's --key .pub) "
        "allowed to push partial aggregates here; without it partials are refused")})
    join_token: str = ""
    tls_cert: str = field(default="", metadata={"help": "serve TLS with this certificate "
                                                         "(PEM; from `murmura certs server`)"})
    tls_key: str = field(default="", metadata={"help": "the private key of --tls-cert (PEM)"})
    client_ca: str = field(default="", metadata={"help": (
        "mutual TLS: require client certificates signed by this CA (PEM)")})
    insecure: bool = field(default=False, metadata={"help": (
        "allow plaintext on a non-loopback address (serving, or the leaf's upstream link)")})
    max_payload_mb: float = 1024.0
    session_ttl_s: float = 3600.0  # a session unused this long expires (0: never)
    max_sessions: int = 100_000    # joins beyond this many live sessions are refused
    dedup_ttl_s: float = 3600.0    # counted update ids and payload hashes are kept this long
    join_per_s: float = 1.0        # joins per second per client id, bursts of 10 (0: no limit)
    push_per_s: float = 10.0       # pushes per second per client id, bursts of 50 (0: no limit)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key (--tls-cert, --tls-key)")
        if self.client_ca and not self.tls_cert:
            raise ValueError("client_ca (mutual TLS) needs tls_cert and tls_key too")
        if self.leaf_keys and not self.require_identity:
            raise ValueError("leaf_keys needs require_identity (leaves are told apart from "
                             "clients by the key they prove)")
        if self.allowed_keys and not self.require_identity:
            raise ValueError("allowed_keys needs require_identity (an allow-list of keys "
                             "means nothing when clients need not prove a key)")
        if not self.max_payload_mb > 0:
            raise ValueError(f"max_payload_mb must be positive, got {self.max_payload_mb}")
        for name in ("session_ttl_s", "dedup_ttl_s", "join_per_s", "push_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {value}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * (1 << 20))


@dataclass(frozen=True)
class LeafConfig:
    """Where this aggregator sits in a hierarchy: the top, or a leaf that folds its clients'
    updates and pushes the partial aggregate to its parent over an upstream link."""

    role: str = "top"              # top, or leaf: fold clients' updates and push upstream
    upstream: str = ""             # leaf: the parent aggregator's HOST:PORT
    name: str = ""                 # leaf: its name in logs (its id at the parent: its --key)
    key: str = field(default="", metadata={"help": (
        "leaf: identity key FILE for the upstream link (default: a new ephemeral key)")})
    upstream_tls_ca: str = field(default="", metadata={"help": (
        "leaf: CA certificate that signed the parent's TLS certificate")})
    upstream_tls_cert: str = field(default="", metadata={"help": (
        "leaf: client certificate for a parent that requires mutual TLS")})
    upstream_tls_key: str = field(default="", metadata={"help": (
        "leaf: the private key of --upstream-tls-cert")})

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role == "leaf" and not self.upstream:
            raise ValueError("role 'leaf' needs upstream HOST:PORT (the parent aggregator)")
        if self.role != "leaf" and self.upstream:
            raise ValueError("upstream is only for role 'leaf'")
        if bool(self.upstream_tls_cert) != bool(self.upstream_tls_key):
            raise ValueError("upstream_tls_cert and upstream_tls_key go together")
        if self.upstream_tls_cert and not self.upstream_tls_ca:
            raise ValueError("upstream_tls_cert (mutual TLS) needs upstream_tls_ca")
        if self.role != "leaf" and (self.key or self.upstream_tls_ca):
            raise ValueError("key and upstream_tls_* are for role 'leaf' (its upstream link)")


@dataclass(frozen=True)
class PrivacyConfig:
    """Client-level differential privacy: DP-FedAvg with noise added by the server (central
    DP), fixed or adaptive clipping, epsilon from dp-accounting; docs/privacy.md. On when
    ``dp_clip`` > 0."""

    dp_clip: float = field(default=0.0, metadata={"help": (
        "differential privacy: clip each client's update to this L2 norm and average clients "
        "with equal weights (0: DP off; docs/privacy.md)")})
    dp_noise_multiplier: float = field(default=0.0, metadata={"help": (
        "DP: Gaussian noise of std this x the clip on the sum of the clipped updates, once "
        "per version (>= 0; 0: clipping only, epsilon infinite)")})
    dp_clip_adaptive: float = field(default=0.0, metadata={"help": (
        "DP: adapt the clip toward this quantile of the update norms (Andrew et al. 2021; "
        "in (0, 1), e.g. 0.5; 0: fixed clip); --dp-clip is the first clip")})
    dp_clip_lr: float = field(default=0.2, metadata={"help": (
        "DP: learning rate of the adaptive clip (C <- C exp(-lr (share below C - quantile)))")})
    dp_clip_count_noise: float = field(default=0.0, metadata={"help": (
        "DP: std of the noise on the adaptive clip's count (0: cohort / 20, at least the "
        "noise multiplier)")})
    dp_delta: float = field(default=1e-5, metadata={"help": (
        "DP: the delta epsilon is reported at, in (0, 1); keep it below 1 / clients")})
    dp_target_epsilon: float = field(default=0.0, metadata={"help": (
        "DP: stop the run before a version whose epsilon would exceed this (0: no limit)")})
    secure_aggregation: bool = field(default=False, metadata={"help": (
        "SecAgg+: the server learns only the sum of each sync round's (or async buffer's) "
        "updates (clients mask them; docs/privacy.md); needs --defense fedavg; with --dp-clip "
        "the clients add the noise (distributed DP)")})
    secagg_clip: float = field(default=1.0, metadata={"help": (
        "secure aggregation: clients clip each value of their update to [-this, this] before "
        "quantising it into the ring (values beyond are cut)")})
    secagg_bits: int = field(default=32, metadata={"help": (
        "secure aggregation: the ring Z_2^bits (8..64; 32 sends 4 bytes a value, like float32)")})
    secagg_max_weight: float = field(default=1000.0, metadata={"help": (
        "secure aggregation: a client weighs min(examples, this) in the mean")})
    secagg_dropout: float = field(default=0.3, metadata={"help": (
        "secure aggregation: the fraction of a round's clients that may drop out; sizes the "
        "neighbour graph (in [0, 0.5))")})
    secagg_step_timeout_s: float = field(default=30.0, metadata={"help": (
        "secure aggregation: how long each protocol step waits for the slowest client")})

    def __post_init__(self) -> None:
        for name in ("dp_clip", "dp_noise_multiplier", "dp_clip_count_noise",
                     "dp_target_epsilon"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not 0 <= self.dp_clip_adaptive < 1:
            raise ValueError(f"dp_clip_adaptive (the target quantile) must lie in (0, 1), or "
                             f"be 0 for a fixed clip; got {self.dp_clip_adaptive}")
        if not (math.isfinite(self.dp_clip_lr) and self.dp_clip_lr > 0):
            raise ValueError(f"dp_clip_lr must be positive, got {self.dp_clip_lr}")
        if not 0 < self.dp_delta < 1:
            raise ValueError(f"dp_delta must lie in (0, 1), got {self.dp_delta}")
        given = [n for n in ("dp_noise_multiplier", "dp_clip_adaptive", "dp_clip_count_noise",
                             "dp_target_epsilon") if getattr(self, n)]
        if given and not self.enabled:
            raise ValueError(f"{given[0]} needs dp_clip (--dp-clip C > 0), which turns "
                             f"differential privacy on")
        if self.dp_target_epsilon and not self.dp_noise_multiplier:
            raise ValueError("dp_target_epsilon needs dp_noise_multiplier > 0 (without noise "
                             "epsilon is infinite from the first version)")
        if self.dp_clip_count_noise and not self.dp_clip_adaptive:
            raise ValueError("dp_clip_count_noise is for the adaptive clip (dp_clip_adaptive)")
        if self.dp_clip_count_noise and not 2 * self.dp_clip_count_noise > \
                self.dp_noise_multiplier:
            raise ValueError(f"dp_clip_count_noise {self.dp_clip_count_noise:g} must exceed "
                             f"half of dp_noise_multiplier {self.dp_noise_multiplier:g} (the "
                             f"count's noise is part of the multiplier's budget)")
        if self.enabled:
            from murmura.server.privacy import require_accounting

            require_accounting()

    @property
    def enabled(self) -> bool:
        return self.dp_clip > 0

    def secagg_params(self) -> SecAggParams | None:
        """The encoding clients quantise into, or None without secure aggregation."""
        if not self.secure_aggregation:
            return None
        from murmura.protocols.secagg.weighted import SecAggParams

        return SecAggParams(bits=self.secagg_bits, clip=self.secagg_clip,
                            max_weight=self.secagg_max_weight,
                            dp_clip=self.dp_clip if self.enabled else 0.0,
                            dp_noise_multiplier=self.dp_noise_multiplier if self.enabled
                            else 0.0)

    def _check_secagg(self) -> None:
        if not 0 <= self.secagg_dropout < 0.5:
            raise ValueError(f"secagg_dropout must be in [0, 0.5), got {self.secagg_dropout}")
        if not (math.isfinite(self.secagg_step_timeout_s) and self.secagg_step_timeout_s > 0):
            raise ValueError(f"secagg_step_timeout_s must be positive, got "
                             f"{self.secagg_step_timeout_s}")
        self.secagg_params()  # ValueError for bits, clip or max_weight out of range
