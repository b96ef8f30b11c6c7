"""Typed, self-validating configuration of the aggregator service.

:class:`ServerConfig` holds what identifies a run (where it serves, its mode and length, its
seed, what clients train) and one frozen sub-config per concern, each checking its own fields:

* ``policy`` (:class:`PolicyConfig`): when versions are made and how updates are combined;
* ``tier`` (:class:`TierConfig`): where updates are decoded;
* ``security`` (:class:`SecurityConfig`): who may join and push, over what, and how much;
* ``leaf`` (:class:`LeafConfig`): a leaf aggregator's place in a hierarchy and its link up.
* ``privacy`` (:class:`PrivacyConfig`): client-level differential privacy (docs/privacy.md).

``ServerConfig`` itself checks what spans them (a leaf needs a decomposable rule, plaintext
needs a loopback address or ``insecure``, ...).

People name the settings flat: ``--buffer-size 5`` on the command line, ``buffer_size = 5`` in
a config file's ``[server]`` table. That flat namespace is the fields declared here, flattened
by server/flat_keys.py: :meth:`ServerConfig.from_flat` builds a config from flat keys (the
command line, config files, tests and benchmarks all build configs this way),
:meth:`ServerConfig.flat` gives them back, and code reads the nested fields
(``config.policy.buffer_size``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from murmura.protocols.messages import TaskSettings
from murmura.server.compass import COMPASS_STEPS, StepBounds
from murmura.server.config_sections import (  # the sections, importable from here as before
    ACCUMULATORS,
    BACKENDS,
    ROLES,
    STALENESS,
    WORKER_FOLDS,
    LeafConfig,
    PolicyConfig,
    PrivacyConfig,
    SecurityConfig,
    TierConfig,
)
from murmura.server.flat_keys import FlatKeys

MODES = ("sync", "async", "compass")

__all__ = ["ACCUMULATORS", "BACKENDS", "COMPASS_STEPS", "MODES", "ROLES", "STALENESS",
           "WORKER_FOLDS", "LeafConfig", "PolicyConfig", "PrivacyConfig", "SecurityConfig",
           "ServerConfig", "TierConfig", "check_metrics_address"]


#: ServerConfig's sub-configs by field name; their fields are flat keys of the server's.
_GROUPS: dict[str, type] = {"policy": PolicyConfig, "tier": TierConfig,
                            "security": SecurityConfig, "leaf": LeafConfig,
                            "privacy": PrivacyConfig}


@dataclass(frozen=True)
class ServerConfig:
    """How the aggregator accepts, weighs and applies updates.

    Build one from flat keys, the flags' and config files' names:
    ``ServerConfig.from_flat(mode="async", buffer_size=10, tls_cert=...)``; read it by concern:
    ``config.policy.buffer_size``, ``config.security.tls_cert``. ``mode='sync'`` runs rounds
    over a cohort; ``mode='async'`` applies a FedBuff step every ``policy.buffer_size``
    updates; ``mode='compass'`` runs FedCompass (:class:`PolicyConfig`).
    """

    address: str = "127.0.0.1:0"
    metrics_address: str = field(default="", metadata={"help": (
        "serve Prometheus metrics on HOST:PORT (port 0: any free port, logged at start; "
        "needs pip install \"murmura[ops]\"; docs/operations.md)")})
    mode: str = "sync"
    max_versions: int = 30
    seed: int = 0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    leaf: LeafConfig = field(default_factory=LeafConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    # what clients do
    train: TaskSettings = field(default_factory=TaskSettings)

    def __post_init__(self) -> None:
        check_metrics_address(self.metrics_address)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {self.max_versions}")
        from murmura.protocols import CodecError
        from murmura.protocols.pool import seed_pool_for

        try:
            pool = seed_pool_for(self.train)
        except CodecError as exc:
            raise ValueError(f"train.codec_options: {exc}") from None
        policy = self.policy
        if pool is not None and policy.optimizer != "fedavg":
            raise ValueError(f"a seed pool (codec 'seed' with pool={len(pool)}) aggregates in "
                             f"pool coordinates, where only the linear 'fedavg' server optimizer "
                             f"is defined; got optimizer {policy.optimizer!r}")
        if self.leaf.role == "leaf" and not policy.decomposable:
            raise ValueError(f"a leaf forwards a partial aggregate, which needs a "
                             f"decomposable rule (fedavg); defense {policy.defense!r} needs "
                             f"every update: run it at the top")
        if self.mode == "compass":
            self.compass_bounds()  # raises ValueError on bad bounds
        elif policy.compass_max_steps or policy.compass_min_steps:
            raise ValueError("compass_max_steps and compass_min_steps are for mode 'compass'")
        if self.privacy.enabled:
            self._check_privacy()
        if self.privacy.secure_aggregation:
            self._check_secure_aggregation()
        self._check_plaintext()

    def _check_secure_aggregation(self) -> None:
        """What secure aggregation composes with (docs/privacy.md): the server sees only the
        sum of a sync round's masked inputs, so anything that needs one update, or a sum
        formed elsewhere, is refused with one line naming what works."""
        self.privacy._check_secagg()
        works = "it runs with --mode sync, --defense fedavg and a dense update"
        if self.mode not in ("sync", "async"):
            raise ValueError(f"secure aggregation runs sync rounds (a round's cohort is the "
                             f"masked group) or async FedBuff (a buffer is the group); mode "
                             f"{self.mode!r} forms groups from client speeds and is refused")
        if not self.policy.decomposable or self.policy.defense != "fedavg":
            raise ValueError(f"secure aggregation hides each update, so defense "
                             f"{self.policy.defense!r}, which must see every update, cannot "
                             f"run; {works}")
        if self.policy.accumulator != "float32":
            raise ValueError(f"secure aggregation sums in its own ring; drop --accumulator "
                             f"{self.policy.accumulator}")
        if self.leaf.role == "leaf" or self.security.leaf_keys:
            raise ValueError("secure aggregation needs clients connected directly to the top "
                             "aggregator: a leaf's partial aggregate is a sum the top cannot "
                             "unmask (drop --role leaf / --leaf-keys)")
        if self.privacy.enabled and (self.privacy.dp_clip_adaptive
                                     or self.privacy.dp_clip_count_noise):
            raise ValueError("secure aggregation with --dp-clip runs distributed DP with a "
                             "fixed clip: the adaptive clip needs each update's norm, which "
                             "the server no longer sees (drop --dp-clip-adaptive)")
        if self.train.trainer != "sgd" or self.train.codec not in ("dense-f32", ""):
            raise ValueError(f"secure aggregation masks the dense update: trainer "
                             f"{self.train.trainer!r} with codec {self.train.codec!r} cannot "
                             f"be masked; use --trainer sgd and the dense codec")

    def _check_privacy(self) -> None:
        """What differential privacy composes with (docs/privacy.md): one line naming what
        works, for everything else."""
        if self.mode == "compass":
            raise ValueError("differential privacy (--dp-clip) runs in mode sync or async; "
                             "compass's group sizes depend on client speeds, so a version has "
                             "no denominator fixed in advance")
        if not self.policy.decomposable:
            raise ValueError(f"differential privacy (--dp-clip) clips each update and noises "
                             f"their sum, which needs --defense fedavg; defense "
                             f"{self.policy.defense!r} must see every update before noise")
        if self.leaf.role == "leaf" or self.security.leaf_keys:
            raise ValueError("differential privacy (--dp-clip) runs at the top aggregator with "
                             "clients connected directly: a leaf's partial aggregate cannot be "
                             "clipped per client (drop --role leaf / --leaf-keys)")

    def _check_plaintext(self) -> None:
        """Plaintext only on loopback, unless ``insecure`` says so: serving, and a leaf's
        upstream link."""
        from murmura.protocols.tls import is_loopback

        security, leaf = self.security, self.leaf
        if not security.tls_cert and not security.insecure and not is_loopback(self.address):
            raise ValueError(f"refusing to serve plaintext on {self.address[:60]}: give "
                             f"--tls-cert and --tls-key (see docs/security.md), bind a loopback "
                             f"address, or pass --insecure")
        if leaf.role == "leaf" and not leaf.upstream_tls_ca and not security.insecure \
                and not is_loopback(leaf.upstream):
            raise ValueError(f"refusing a plaintext upstream link to {leaf.upstream[:60]}: "
                             f"give --upstream-tls-ca (see docs/security.md) or --insecure")

    def compass_bounds(self) -> StepBounds:
        """FedCompass's local step bounds and latest-arrival factor."""
        p = self.policy
        q_max = p.compass_max_steps or self.train.local_steps
        if q_max <= 0:
            raise ValueError("mode 'compass' assigns local steps: set compass_max_steps (or "
                             "train.local_steps) to a positive number")
        q_min = p.compass_min_steps or max(1, round(q_max / 5))
        if p.compass_min_steps < 0 or p.compass_max_steps < 0 or q_min > q_max:
            raise ValueError(f"compass_min_steps {q_min} and compass_max_steps {q_max} need "
                             f"1 <= min <= max (0 for a default: max = train.local_steps, min = "
                             f"a fifth of max)")
        return StepBounds(q_min, q_max, p.compass_latest_factor, p.compass_max_group)

    # -- the flat namespace -------------------------------------------------------------------

    @classmethod
    def flat_fields(cls) -> dict[str, tuple[type, dataclasses.Field[Any]]]:
        """Every flat key, in order, with the class that declares its field (ServerConfig or
        a sub-config): the flags and ``[server]`` keys. ``train`` is one key, a nested
        :class:`TaskSettings` (its own ``[server.train]`` table)."""
        return _FLAT.fields()

    @classmethod
    def from_flat(cls, **values: Any) -> ServerConfig:
        """A config from flat keys (``buffer_size=10, tls_cert=...``); keys left out keep
        their defaults. An unknown key is a TypeError, as for any constructor."""
        return cls(**_FLAT.arguments(values))

    def flat(self) -> dict[str, Any]:
        """Every flat key with its value: ``ServerConfig.from_flat(**config.flat()) ==
        config``."""
        return _FLAT.values(self)

    def replace(self, **changes: Any) -> ServerConfig:
        """This config with some flat keys changed (``dataclasses.replace`` by flat key); the
        result checks itself whole again."""
        return self.from_flat(**{**self.flat(), **changes})

    def table(self) -> dict[str, Any]:
        """The config as a config file's ``[server]`` table: flat keys, ``train`` as its
        sub-table. What a run's summary.json records, readable back by the command line."""
        return {**self.flat(), "train": dataclasses.asdict(self.train)}


def check_metrics_address(value: str, what: str = "metrics_address") -> None:
    """An empty value (no endpoint) or HOST:PORT with prometheus-client installed: checked
    with the config, so a typo or a missing extra stops the command before anything starts."""
    if not value:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:9100; port 0: any free "
                         f"port), got {value[:60]!r}")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ValueError(f'{what}: Prometheus metrics need prometheus-client, which is not '
                         f'installed: pip install "murmura[ops]"')


#: The flat namespace (a TypeError at import if two fields share a name).
_FLAT = FlatKeys(ServerConfig, _GROUPS)
