"""A Message-API Flower ``ClientApp`` (``@app.train()``, ``@app.evaluate()``) as a Murmura
:class:`Trainer`.

Each Murmura task becomes the message a Flower SuperNode would hand the app: a ``train``
message whose content holds the global model as an ``ArrayRecord`` under ``"arrays"`` (the
keys, shapes and dtypes of the app's own initial arrays, so ``to_torch_state_dict()`` loads
it) and a ``ConfigRecord`` under ``"config"`` with the ServerApp's train config and Murmura's
settings (``lr``, ``local_epochs``, ``server-round``...). The reply's ``ArrayRecord`` becomes
the update; its ``MetricRecord``'s ``num-examples`` is the update's weight and its other
numeric entries travel as the update's metrics.

The ``Context`` is the one a Flower SuperNode builds: ``node_config`` has ``partition-id``
(the client index) and ``num-partitions`` (the number of clients), ``run_config`` the app's
run config, and ``state`` persists across the client's tasks.

An ``@app.query()`` handler is asked once, when the client is created, for the client's
properties (:meth:`MessageAppTrainer.query`): they go into its join profile
(:func:`~murmura.client.flower_load.run_flower_client`) or, simulated, into summary.json.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from murmura.client.flower_app import FlowerAppError
from murmura.client.trainer import Trainer, TrainResult
from murmura.protocols import FlatVector, ModelSpec, TaskSettings
from murmura.protocols.spec import TensorSpec

_FLOAT = ("float16", "float32", "float64")
#: A property value, as Flower's ``get_properties`` returns them.
Scalar = bool | int | float | str
#: What the query message asks (its ``ConfigRecord`` under ``"config"``).
QUERY_CONFIG: dict[str, str] = {"query": "properties"}
#: Evaluation metrics ride on the next update as ``eval_<name>`` (server/client_eval.py).
_EVAL_PREFIX = "eval_"


def is_message_app(app: Any) -> bool:
    """Whether ``app`` is a ``ClientApp`` written with ``@app.train()`` handlers (rather than
    built from a ``client_fn``). flwr keeps both in private fields; this reads them."""
    registered = getattr(app, "_registered_funcs", None) or {}
    return getattr(app, "_call", None) is None and any(
        k.startswith("train.") for k in registered)


def spec_from_record(name: str, record: Any) -> tuple[ModelSpec, dict[str, npt.NDArray[Any]]]:
    """The :class:`ModelSpec` of an ``ArrayRecord`` (its floating arrays, by key) and all its
    arrays as numpy."""
    arrays = {k: np.asarray(record[k].numpy()) for k in record}
    tensors = []
    for k, a in arrays.items():
        if a.dtype.name in _FLOAT:
            tensors.append(TensorSpec(k, tuple(int(d) for d in a.shape), a.dtype.name))
        elif a.dtype.kind not in "iub":
            raise FlowerAppError(f"{name}: array {k[:40]!r} has dtype {a.dtype.name}; expected "
                                 f"floating or integer arrays")
    if not tensors:
        raise FlowerAppError(f"{name}: the initial model has no floating-point array to train")
    return ModelSpec(tuple(tensors)), arrays


class MessageAppTrainer(Trainer):
    """A Message-API ``ClientApp`` driven task by task (see the module docstring)."""

    def __init__(self, app: Any, context: Any, initial: Any, *, name: str = "the ClientApp",
                 train_config: dict[str, Any] | None = None) -> None:
        self.app, self.context, self.name = app, context, name
        self.spec, self._arrays = spec_from_record(name, initial)
        self.train_config = dict(train_config or {})
        registered = getattr(app, "_registered_funcs", None) or {}
        self.has_evaluate = any(k.startswith("evaluate.") for k in registered)
        self.has_query = "query.default" in registered
        self._version: int | None = None
        self._last_eval: int | None = None
        self._count = 0
        #: Server settings the app's own config suggests (client/flower.py: app_defaults).
        self.app_defaults: dict[str, Any] = {}
        self.run_config: dict[str, Any] = dict(context.run_config)

    # -- the model as Flower records ----------------------------------------------------------

    def initial(self) -> FlatVector:
        """The app's initial model as a flat vector (what the server starts from)."""
        return self._flatten(self._arrays, "the initial model")

    def _flatten(self, arrays: dict[str, npt.NDArray[Any]], what: str) -> FlatVector:
        out = np.empty(self.spec.size, dtype=np.float32)
        for t, off in zip(self.spec.tensors, self.spec.offsets(), strict=True):
            a = arrays.get(t.name)
            if a is None:
                raise FlowerAppError(f"{self.name}: {what} has no array {t.name[:40]!r}")
            if tuple(a.shape) != t.shape:
                raise FlowerAppError(f"{self.name}: {what} has array {t.name[:40]!r} of shape "
                                     f"{tuple(a.shape)}; expected {t.shape}")
            out[off : off + t.numel] = np.asarray(a, dtype=np.float32).reshape(-1)
        if not np.all(np.isfinite(out)):
            raise FlowerAppError(f"{self.name}: {what} has non-finite values")
        return out

    def _record(self, params: FlatVector) -> Any:
        """``params`` as the app's ``ArrayRecord``: floating arrays from the vector in their
        own dtype, integer arrays (say BatchNorm counters) from this client's last values."""
        from flwr.app import Array, ArrayRecord

        views = self.spec.unflatten(np.asarray(params, dtype=np.float32))
        out = {}
        for k, a in self._arrays.items():
            v = np.array(views[k], dtype=a.dtype) if k in views else np.array(a, copy=True)
            out[k] = Array(v)
        return ArrayRecord(out)

    # -- messages ------------------------------------------------------------------------

    def _send(self, content: Any, message_type: str) -> Any:
        from flwr.app import Message, Metadata

        # Metadata given whole: outside a SuperNode no run or message ids exist, and the
        # app's reply (Message(content, reply_to=msg)) needs them.
        self._count += 1
        meta = Metadata(run_id=0, message_id=f"murmura-{self._count}", src_node_id=0,
                        dst_node_id=self.context.node_id, reply_to_message_id="",
                        group_id=str(self._version or 0), created_at=time.time(),
                        ttl=3600.0, message_type=message_type)
        make: Any = Message  # the metadata= form is missing from flwr's overloads
        try:
            reply = self.app(make(content=content, metadata=meta), self.context)
        except Exception as exc:
            raise FlowerAppError(f"{self.name}'s {message_type} handler failed: "
                                 f"{type(exc).__name__}: {str(exc)[:100]}") from exc
        if not hasattr(reply, "has_error"):
            raise FlowerAppError(f"{self.name}'s {message_type} handler returned a "
                                 f"{type(reply).__name__}; expected a Message")
        if reply.has_error():
            raise FlowerAppError(f"{self.name}'s {message_type} handler replied with an "
                                 f"error: {str(reply.error.reason)[:100]}")
        return reply.content

    def _metrics(self, content: Any, handler: str) -> tuple[int, dict[str, float]]:
        """(``num-examples``, the other numeric metrics) of a reply's MetricRecords."""
        merged: dict[str, Any] = {}
        for record in content.metric_records.values():
            merged.update(record)
        n = merged.pop("num-examples", None)
        if n is None:
            raise FlowerAppError(f"{self.name}'s {handler} handler replied with no "
                                 f"'num-examples' in a MetricRecord (Flower's FedAvg needs it "
                                 f"too)")
        if not float(n) > 0 or float(n) != int(n):
            raise FlowerAppError(f"{self.name}'s {handler} handler reported num-examples "
                                 f"{n!r}; expected a positive whole number")
        return int(n), {k: float(v) for k, v in merged.items()
                        if isinstance(v, int | float) and not isinstance(v, bool)}

    def _config(self, settings: TaskSettings, seed: int) -> Any:
        from flwr.app import ConfigRecord

        from murmura.client.flower import settings_config

        return ConfigRecord({**self.train_config, **settings_config(settings, seed,
                                                                    self._version)})

    # -- Trainer ------------------------------------------------------------------------

    def on_pull(self, version: int) -> None:
        self._version = version

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        from flwr.app import ArrayRecord, RecordDict

        report: dict[str, float] = {}
        every = settings.client_eval_every
        version = self._version or 0
        if every and self.has_evaluate and (self._last_eval is None
                                            or version // every > self._last_eval // every):
            report = self.evaluate_report(params, settings, seed)
            self._last_eval = version
        _seed(seed)
        content = self._send(RecordDict({"arrays": self._record(params),
                                         "config": self._config(settings, seed)}), "train")
        records = list(content.array_records.items())
        if not records:
            raise FlowerAppError(f"{self.name}'s train handler replied with no ArrayRecord "
                                 f"(put the trained model in the reply, as "
                                 f"RecordDict({{'arrays': ArrayRecord(...), ...}}))")
        if len(records) > 1:
            named = dict(records)
            if "arrays" not in named:
                raise FlowerAppError(f"{self.name}'s train handler replied with "
                                     f"{len(records)} ArrayRecords and none named 'arrays'")
            records = [("arrays", named["arrays"])]
        record = records[0][1]
        assert isinstance(record, ArrayRecord)
        arrays = {k: np.asarray(record[k].numpy()) for k in record}
        flat = self._flatten(arrays, "the train handler's reply")
        n, metrics = self._metrics(content, "train")
        for k, a in self._arrays.items():  # integer arrays stay local: keep the new values
            if a.dtype.kind in "iub" and k in arrays and arrays[k].shape == a.shape:
                self._arrays[k] = arrays[k]
        metrics.update(report)
        return TrainResult(flat, n, metrics)

    # -- properties ----------------------------------------------------------------------

    def query(self) -> dict[str, Scalar] | None:
        """The app's ``@app.query()`` handler, asked once for the client's properties, as a
        Flower ``ServerApp`` asks with a ``query`` message (the Message API's form of
        ``get_properties``): the message carries ``ConfigRecord({"query": "properties"})``
        under ``"config"``; the scalar entries of the reply's ConfigRecords and MetricRecords
        are the properties. None when the app has no query handler."""
        from flwr.app import ConfigRecord, RecordDict

        if not self.has_query:
            return None
        content = self._send(RecordDict({"config": ConfigRecord(dict(QUERY_CONFIG))}), "query")
        return scalars(content)

    # -- evaluation ----------------------------------------------------------------------

    def evaluate(self, params: FlatVector, settings: TaskSettings | None = None,
                 seed: int = 0) -> tuple[int, dict[str, float]]:
        """The app's evaluate handler on ``params``: (num-examples, its numeric metrics)."""
        from flwr.app import RecordDict

        if not self.has_evaluate:
            raise FlowerAppError(f"{self.name} has no @app.evaluate() handler")
        _seed(seed)
        content = self._send(RecordDict({"arrays": self._record(params),
                                         "config": self._config(settings or TaskSettings(),
                                                                seed)}), "evaluate")
        return self._metrics(content, "evaluate")

    def evaluate_report(self, params: FlatVector, settings: TaskSettings, seed: int
                        ) -> dict[str, float]:
        """An evaluation of the global model on this client, as the ``eval_*`` metrics the
        server folds into ``client_<metric>_mean/min/max`` (``eval_acc`` stays ``eval_acc``,
        ``loss`` becomes ``eval_loss``)."""
        n, metrics = self.evaluate(params, settings, seed)
        out = {"eval_version": float(self._version or 0), "eval_examples": float(n)}
        for k, v in metrics.items():
            out[k if k.startswith(_EVAL_PREFIX) else _EVAL_PREFIX + k] = v
        return out

    def evaluator(self) -> Any:
        """A server-side evaluator (flat vector -> metrics) from the evaluate handler, or None
        without one. ``accuracy`` and ``loss`` are filled from the first of ``accuracy``,
        ``eval_acc``, ``eval_accuracy``, ``acc`` (and ``loss``, ``eval_loss``) the app reports,
        so the summary's accuracy is the app's."""
        if not self.has_evaluate:
            return None

        def run(params: FlatVector) -> dict[str, float]:
            _, metrics = self.evaluate(params)
            out = dict(metrics)
            for target, names in (("accuracy", ("accuracy", "eval_acc", "eval_accuracy",
                                                "acc")), ("loss", ("loss", "eval_loss"))):
                found = next((metrics[k] for k in names if k in metrics), None)
                if found is not None:
                    out[target] = found
            return out
        return run


def scalars(content: Any) -> dict[str, Scalar]:
    """The scalar entries (bool, int, float, str) of a reply's ConfigRecords and
    MetricRecords, merged in record order; lists and bytes are left out."""
    out: dict[str, Scalar] = {}
    for records in (content.config_records, content.metric_records):
        for record in records.values():
            for k, v in record.items():
                if isinstance(v, bool | int | float | str):
                    out[str(k)] = v
    return out


def _seed(seed: int) -> None:
    """Seed the generators an app's handler may draw from (torch if loaded, numpy's and
    Python's global ones): a task's result depends on its seed only, as for Murmura's own
    trainers."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed % 2**63)
    np.random.seed(seed % 2**32)
    random.seed(seed)


__all__ = ["QUERY_CONFIG", "MessageAppTrainer", "Scalar", "is_message_app", "scalars",
           "spec_from_record"]
