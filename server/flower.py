"""Flower interop on the server side, both ways.

* :func:`flower_core` — ``murmura server --flower-app MODULE:ATTR``: serve the model a Flower
  client starts from (its ``get_parameters``), so Flower clients run as Murmura clients.
* :class:`MurmuraStrategy` and its named variants — Murmura's aggregation rules (robust rules,
  Sybil weighting) and FedBuff-style staleness weighting as Flower strategies over
  ``flwr.serverapp.strategy.FedAvg``: Flower keeps its sampling and messaging, Murmura computes
  the aggregate. Use one in a Flower ``ServerApp`` in place of ``FedAvg``.

The rules themselves stay in :mod:`murmura.aggregation` (pure, no flwr): the strategy turns each
reply into an update (the client's arrays minus the global arrays sent to it), feeds the rule,
and adds the rule's aggregate back to the global arrays.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg
except ImportError as exc:  # Flower is the [flower] extra
    raise ImportError("murmura.server.flower needs Flower: pip install 'murmura[flower]'"
                      ) from exc

from murmura.aggregation import (
    AggregationError,
    Aggregator,
    StalenessFn,
    create_aggregator,
    staleness_function,
)
from murmura.client.flower_load import load_flower_client
from murmura.server.app import assemble_core
from murmura.server.client_train import ClientTrainMetrics
from murmura.server.config import ServerConfig
from murmura.server.core import AggregatorCore

log = logging.getLogger(__name__)

#: The MetricRecord key in which a client reports the ``server-round`` whose global arrays it
#: trained from; replies without it count as fresh (staleness 0).
TRAINED_ROUND_KEY = "trained-round"


def flower_core(config: ServerConfig, ref: str, *, out_dir: str | Path | None,
                resume: str | Path | None = None, durable: bool = False,
                evaluate: bool = True, run_config: str | dict[str, Any] | None = None,
                given: Iterable[str] | None = None,
                extra_config: dict[str, Any] | None = None) -> AggregatorCore:
    """An aggregator core for the model of the Flower app at ``ref`` (``MODULE:ATTR`` or an
    app directory; see :func:`murmura.client.flower_load.load_flower_client`).

    The initial global model is what the app gives for partition 0 of 1 (``get_parameters``,
    or the arrays its ServerApp starts from), so every client built by the same code has the
    same :class:`ModelSpec`. Server settings the app's own config names (its ``lr``,
    ``local-epochs``, ``num-server-rounds``) replace the defaults of those not in ``given``
    (the flat keys the user set). When the app evaluates (a NumPyClient's ``evaluate`` or an
    ``@app.evaluate()`` handler), the server evaluates each global version with it, which
    fills ``accuracy`` in metrics.jsonl when the app reports one; the clients' training
    metrics go into each row as ``client_train_<name>_mean`` (server/client_train.py).
    """
    config, trainer = flower_config(config, ref, run_config=run_config, given=given)
    evaluator = trainer.evaluator() if evaluate else None
    log.info("serving the Flower app %s: %d arrays, %d values%s", ref[:60],
             len(trainer.spec.tensors), trainer.spec.size,
             ", evaluated with its evaluate()" if evaluator else "")
    table = {"server": config.table(), "flower_app": ref,
             "flower_run_config": trainer_run_config(trainer), **(extra_config or {})}
    core = assemble_core(config, trainer.spec, trainer.initial(), out_dir=out_dir,
                         resume=resume, evaluator=evaluator, durable=durable,
                         run_config=table)
    core.client_train = ClientTrainMetrics()
    return core


def flower_config(config: ServerConfig, ref: str, *, run_config: str | dict[str, Any] | None,
                  given: Iterable[str] | None = None, num_clients: int = 1
                  ) -> tuple[ServerConfig, Any]:
    """(``config`` with the app's suggested settings where the user gave none, the app's
    trainer for partition 0 of ``num_clients``)."""
    trainer = load_flower_client(ref, client_index=0, num_clients=num_clients,
                                 run_config_overrides=run_config, seed=config.seed)
    taken = set(given or ())
    train = {k: v for k, v in trainer.app_defaults.items()
             if k not in taken and k in ("lr", "local_epochs")}
    if train:
        config = config.replace(train=dataclasses.replace(config.train, **train))
    if "max_versions" in trainer.app_defaults and "max_versions" not in taken:
        config = config.replace(max_versions=trainer.app_defaults["max_versions"])
    if train or "max_versions" in trainer.app_defaults and "max_versions" not in taken:
        log.info("settings from the Flower app's config: %s",
                 {k: v for k, v in trainer.app_defaults.items() if k not in taken})
    return config, trainer


def trainer_run_config(trainer: Any) -> dict[str, Any]:
    """The run config a Flower trainer's app sees (recorded in summary.json)."""
    return dict(getattr(trainer, "run_config", {}) or {})


def given_keys(args: Any, toml: dict[str, Any]) -> set[str]:
    """The flat server keys the user set, by flag or in the config file's ``[server]`` (or
    ``[server.train]``) table: the app's suggestions do not replace them."""
    server = toml.get("server", {}) or {}
    keys = {k for k in ("lr", "local_epochs", "max_versions")
            if getattr(args, k, None) is not None or k in server
            or k in (server.get("train", {}) or {})}
    return keys


# -- strategies -------------------------------------------------------------------------------

def _is_float(a: npt.NDArray[Any]) -> bool:
    return bool(np.issubdtype(a.dtype, np.floating))


class MurmuraStrategy(FedAvg):
    """Flower's FedAvg sampling and messaging with a Murmura rule computing the aggregate.

    ``rule`` names a rule of :func:`murmura.aggregation.create_aggregator` (``fedavg``,
    ``median``, ``trimmed-mean``, ``krum``, ``centered-clip``, ``sybil``, ``default``, ...)
    with ``rule_options``. One rule instance lives for the whole run, so stateful rules (Sybil
    histories, adaptive clipping) learn across rounds; client ids are Flower node ids.

    ``staleness`` (a name for :func:`murmura.aggregation.staleness_function`, or a function
    tau -> factor) discounts a reply that trained on an older global model, as FedBuff does
    (Nguyen et al., https://arxiv.org/abs/2106.06639): the update's contribution is scaled
    by s(tau) without renormalising, so stale updates shrink the step. tau is the current
    round minus the ``trained-round`` the client reports in its metrics (absent: 0).

    ``server_lr`` scales the aggregate update (1.0: the new model is the aggregate).
    Integer arrays are not aggregated: the global arrays keep their values.
    """

    def __init__(self, rule: str = "default", rule_options: dict[str, Any] | None = None, *,
                 staleness: str | StalenessFn = "constant",
                 staleness_options: dict[str, float] | None = None,
                 server_lr: float = 1.0, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        if not server_lr > 0:
            raise ValueError(f"server_lr must be positive, got {server_lr}")
        self.rule_name = rule
        self.rule_options = dict(rule_options or {})
        create_aggregator(rule, 1, **self.rule_options)  # unknown names fail here, not later
        self.staleness: StalenessFn = (staleness_function(staleness, **(staleness_options or {}))
                                       if isinstance(staleness, str) else staleness)
        self.server_lr = server_lr
        self.rule: Aggregator | None = None
        self._global: list[npt.NDArray[Any]] = []
        self._keys: list[str] = []
        #: Per round: the staleness factor given to each node id (what the last round did).
        self.last_factors: dict[int, float] = {}

    def summary(self) -> None:
        super().summary()
        log.info("Murmura rule %s %s, server_lr %g", self.rule_name, self.rule_options,
                 self.server_lr)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        # aggregate_train only gets the replies: keep the arrays the updates are relative to
        self._keys = list(arrays.keys())
        self._global = [np.array(a, copy=True) for a in arrays.to_numpy_ndarrays()]
        return super().configure_train(server_round, arrays, config, grid)

    def _flat(self, arrays: list[npt.NDArray[Any]]) -> npt.NDArray[np.float32]:
        parts = [np.asarray(a, dtype=np.float32).reshape(-1) for a, g
                 in zip(arrays, self._global, strict=True) if _is_float(g)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid or not self._global:
            return None, None
        base = self._flat(self._global)
        if self.rule is None:
            self.rule = create_aggregator(self.rule_name, base.size, **self.rule_options)
        self.rule.reset()
        self.last_factors = {}
        for msg in valid:
            content = msg.content
            record = next(iter(content.array_records.values()))
            metrics = next(iter(content.metric_records.values()))
            arrays = record.to_numpy_ndarrays()
            if len(arrays) != len(self._global) or any(
                    a.shape != g.shape for a, g in zip(arrays, self._global, strict=True)):
                log.warning("node %d replied with arrays of other shapes; ignored",
                            msg.metadata.src_node_id)
                continue
            update = self._flat(arrays) - base
            if not np.all(np.isfinite(update)):
                log.warning("node %d replied with non-finite arrays; ignored",
                            msg.metadata.src_node_id)
                continue
            trained = int(metrics.get(TRAINED_ROUND_KEY, server_round))  # type: ignore[arg-type]
            factor = self.staleness(max(server_round - trained, 0))
            self.last_factors[msg.metadata.src_node_id] = factor
            self.rule.add(update, float(metrics[self.weighted_by_key]),  # type: ignore[arg-type]
                          factor=factor, client_id=str(msg.metadata.src_node_id))
        try:
            delta = self.rule.result()
        except AggregationError as exc:
            log.warning("round %d: no aggregate (%s)", server_round, exc)
            return None, None
        flat = base + np.float32(self.server_lr) * delta
        out, pos = [], 0
        for g in self._global:
            if _is_float(g):
                out.append(flat[pos : pos + g.size].reshape(g.shape).astype(g.dtype))
                pos += g.size
            else:
                out.append(g)
        new = ArrayRecord({k: Array(a) for k, a in zip(self._keys, out, strict=True)})
        return new, self.train_metrics_aggr_fn([m.content for m in valid],
                                               self.weighted_by_key)


class RobustStrategy(MurmuraStrategy):
    """Murmura's recommended robust rule (``default``: Sybil weighting, a norm cap, then a
    per-coordinate Huber mean) or another robust rule by name: ``median``, ``trimmed-mean``,
    ``krum``..."""

    def __init__(self, rule: str = "default", rule_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(rule, rule_options, **kwargs)


class SybilStrategy(MurmuraStrategy):
    """FoolsGold-style Sybil weighting (``sybil``): clients whose update histories stay
    near-identical are down-weighted (https://arxiv.org/abs/1808.04866)."""

    def __init__(self, rule_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__("sybil", rule_options, **kwargs)


class StalenessStrategy(MurmuraStrategy):
    """FedBuff-style staleness weighting over the weighted mean: s(tau) = (1 + tau) ** -a by
    default (https://arxiv.org/abs/2106.06639)."""

    def __init__(self, staleness: str | StalenessFn = "polynomial",
                 staleness_options: dict[str, float] | None = None, **kwargs: Any) -> None:
        super().__init__("fedavg", staleness=staleness, staleness_options=staleness_options,
                         **kwargs)


__all__ = ["MurmuraStrategy", "RobustStrategy", "StalenessStrategy", "SybilStrategy",
           "TRAINED_ROUND_KEY", "flower_config", "flower_core", "given_keys"]
