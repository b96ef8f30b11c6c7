"""ServerConfig: sub-configs by concern, one flat key namespace for flags and config files."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from typing import Any

import pytest

from murmura.config import build
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.server.config import (
    LeafConfig,
    PolicyConfig,
    PrivacyConfig,
    SecurityConfig,
    TierConfig,
)

SUBS = {"policy": PolicyConfig, "tier": TierConfig, "security": SecurityConfig,
        "leaf": LeafConfig, "privacy": PrivacyConfig}

#: Configs away from the defaults in every sub-config, each valid as a whole.
EXAMPLES: list[dict[str, Any]] = [
    {},
    {"mode": "async", "buffer_size": 3, "max_staleness": 4, "staleness": "hinge",
     "defense": "trimmed-mean", "defense_options": {"trim": "0.2"}, "server_lr": 0.5,
     "workers": 0, "max_queue": 8, "require_identity": False, "push_per_s": 0.0, "seed": 7},
    {"mode": "compass", "compass_max_steps": 10, "compass_step": "linear", "min_clients": 3,
     "address": "0.0.0.0:0", "tls_cert": "c.pem", "tls_key": "k.pem", "client_ca": "ca.pem",
     "allowed_keys": "keys.txt", "train": TaskSettings(local_steps=4, lr=0.05)},
    {"role": "leaf", "upstream": "10.0.0.1:50051", "name": "site-a", "key": "a.key",
     "upstream_tls_ca": "ca.crt", "accumulator": "exact", "cohort_size": 4, "max_workers": 2},
    pytest.param({"mode": "async", "dp_clip": 0.5, "dp_noise_multiplier": 1.1,
                  "dp_clip_adaptive": 0.5, "dp_clip_lr": 0.1, "dp_delta": 1e-6,
                  "dp_target_epsilon": 4.0},
                 marks=pytest.mark.skipif(importlib.util.find_spec("dp_accounting") is None,
                                          reason='DP needs the privacy extra: pip install -e '
                                          '".[privacy]" (in dev)')),
]


def _leaf_paths() -> dict[str, tuple[str, ...]]:
    """Every leaf field of the nested config by its name: ("policy", "buffer_size"), ..."""
    paths: dict[str, list[tuple[str, ...]]] = {}
    for f in dataclasses.fields(ServerConfig):
        inner = [(f.name, g.name) for g in dataclasses.fields(SUBS[f.name])] \
            if f.name in SUBS else [(f.name,)]
        for path in inner:
            paths.setdefault(path[-1], []).append(path)
    ambiguous = {name: p for name, p in paths.items() if len(p) > 1}
    assert not ambiguous, f"one flat key for several fields: {ambiguous}"
    return {name: p[0] for name, p in paths.items()}


def _at(config: ServerConfig, path: tuple[str, ...]) -> Any:
    value: Any = config
    for part in path:
        value = getattr(value, part)
    return value


def test_every_flat_key_is_exactly_one_nested_field() -> None:
    paths = _leaf_paths()
    assert list(ServerConfig.flat_fields()) == list(paths)  # the same keys, in field order
    config = ServerConfig.from_flat(**EXAMPLES[1])
    for key, value in config.flat().items():
        assert _at(config, paths[key]) is value
    for key, (owner, f) in ServerConfig.flat_fields().items():
        assert f in dataclasses.fields(owner) and f.name == key


@pytest.mark.parametrize("values", EXAMPLES)
def test_flat_keys_round_trip(values: dict[str, Any]) -> None:
    config = ServerConfig.from_flat(**values)
    assert ServerConfig.from_flat(**config.flat()) == config
    assert {k: v for k, v in config.flat().items() if k in values} == values
    assert config.replace() == config
    # the [server] table a run's summary.json records reads back through the command line's
    # mapping, flat keys and [server.train] alike
    table = json.loads(json.dumps(config.table()))
    assert build(ServerConfig, table, section="server") == config


def test_the_command_line_mapping_builds_through_from_flat() -> None:
    table = {"mode": "async", "buffer_size": 9, "workers": 0, "join_token": "t",
             "lr": 0.3, "train": {"local_epochs": 2}}
    config = build(ServerConfig, table, section="server")
    assert config == ServerConfig.from_flat(mode="async", buffer_size=9, workers=0,
                                            join_token="t",
                                            train=TaskSettings(lr=0.3, local_epochs=2))
    with pytest.raises(ValueError, match="unknown key 'policy' in \\[server\\]"):
        build(ServerConfig, {"policy": {"buffer_size": 3}}, section="server")


def test_unknown_flat_keys_are_refused_with_a_suggestion() -> None:
    with pytest.raises(TypeError, match="no setting 'bufer_size'; did you mean 'buffer_size'"):
        ServerConfig.from_flat(bufer_size=3)
    with pytest.raises(TypeError, match="no setting 'policy'"):
        ServerConfig.from_flat(policy=PolicyConfig())


def test_each_sub_config_checks_its_own_fields() -> None:
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        PolicyConfig(buffer_size=0)
    with pytest.raises(ValueError, match="accumulator 'exact' needs a decomposable rule"):
        PolicyConfig(defense="median", accumulator="exact")
    with pytest.raises(ValueError, match="ray_address is only for backend 'ray'"):
        TierConfig(ray_address="auto")
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        SecurityConfig(tls_cert="c")
    with pytest.raises(ValueError, match="role 'leaf' needs upstream"):
        LeafConfig(role="leaf")
    assert TierConfig(workers=3).worker_limit == 3
    assert SecurityConfig(max_payload_mb=1).max_payload_bytes == 1 << 20


def test_what_spans_sub_configs_is_checked_whole() -> None:
    with pytest.raises(ValueError, match="a leaf forwards a partial aggregate"):
        ServerConfig.from_flat(role="leaf", upstream="127.0.0.1:1", defense="median")
    with pytest.raises(ValueError, match="refusing a plaintext upstream link to 10.0.0.1"):
        ServerConfig.from_flat(role="leaf", upstream="10.0.0.1:1")
    with pytest.raises(ValueError, match="are for mode 'compass'"):
        ServerConfig.from_flat(compass_max_steps=3)
    config = ServerConfig.from_flat(address="0.0.0.0:0", insecure=True)
    with pytest.raises(ValueError, match="refusing to serve plaintext"):
        config.replace(insecure=False)  # replace checks the result whole again
    assert config.replace(min_clients=5).policy.min_clients == 5
