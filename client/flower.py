"""Run a Flower client unchanged as a Murmura client.

A Flower ``NumPyClient`` already says everything a Murmura :class:`Trainer` needs:
``get_parameters`` gives the model's arrays (their shapes and dtypes become the
:class:`ModelSpec`), and ``fit(parameters, config)`` trains from the global model. The adapter
passes Murmura's task settings (lr, local_epochs, batch_size, seed, ...) in Flower's ``config``
dict, so a client that reads ``config["lr"]`` follows the server's settings.

Accepted by :func:`~murmura.client.flower_load.load_flower_client` (``murmura client
--flower-app MODULE:ATTR``):

* a ``NumPyClient`` instance, or a ``NumPyClient`` subclass that takes no arguments;
* a ``client_fn(context)`` (or zero-argument factory) returning a ``NumPyClient`` or the
  ``Client`` that ``NumPyClient.to_client()`` gives; ``context.node_config`` carries
  ``partition-id`` = the client index and ``num-partitions`` = the number of clients, as
  Flower's simulation sets them;
* a ``ClientApp`` built from such a ``client_fn`` (``ClientApp(client_fn=client_fn)``): it is
  driven through its public message interface (``get_parameters`` and ``train`` messages);
* a Message-API ``ClientApp`` (``@app.train()`` handlers), run by
  :class:`~murmura.client.flower_message.MessageAppTrainer`;
* a Flower app directory (its ``pyproject.toml`` names the ``clientapp``).

The app's ``pyproject.toml`` (found next to or above its module) gives ``context.run_config``
(:mod:`murmura.client.flower_app`). A client with no ``get_parameters`` (and every Message-API
app) takes its initial model from the app's ``ServerApp``, as under ``flwr run``.

Only floating-point arrays are federated; integer arrays (say a BatchNorm
``num_batches_tracked``) stay local, as for Murmura's own torch models. A client that
overrides ``get_properties`` is asked for its properties once (:meth:`FlowerTrainer.query`),
and one that overrides ``evaluate`` evaluates the global model with ``client_eval_every``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from murmura.client.flower_app import (
    FlowerAppError,
)
from murmura.client.flower_message import QUERY_CONFIG, Scalar
from murmura.client.trainer import Trainer, TrainResult
from murmura.protocols import FlatVector, ModelSpec, TaskSettings
from murmura.protocols.spec import TensorSpec

log = logging.getLogger(__name__)

NDArrays = list[npt.NDArray[Any]]
_FLOAT_KINDS = {"float16": "float16", "float32": "float32", "float64": "float64"}


# -- arrays <-> flat vector -------------------------------------------------------------------

def spec_from_arrays(arrays: Sequence[npt.NDArray[Any]]) -> ModelSpec:
    """The :class:`ModelSpec` of a Flower parameter list: one tensor per floating array, named
    by its position (``p000``, ``p001``, ...), as Flower's lists carry no names."""
    tensors = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype.name in _FLOAT_KINDS:
            tensors.append(TensorSpec(f"p{i:03d}", tuple(int(d) for d in a.shape),
                                      _FLOAT_KINDS[a.dtype.name]))
        elif a.dtype.kind not in "iub":
            raise FlowerAppError(f"get_parameters returned array {i} of dtype {a.dtype.name}; "
                                 f"expected floating or integer arrays")
    if not tensors:
        raise FlowerAppError("get_parameters returned no floating-point array to train")
    return ModelSpec(tuple(tensors))


def flatten_arrays(spec: ModelSpec, arrays: Sequence[npt.NDArray[Any]]) -> FlatVector:
    """The floating arrays of ``arrays`` in one float32 vector, checked against ``spec``."""
    out = np.empty(spec.size, dtype=np.float32)
    by_name = {f"p{i:03d}": np.asarray(a) for i, a in enumerate(arrays)}
    for t, off in zip(spec.tensors, spec.offsets(), strict=True):
        a = by_name.get(t.name)
        if a is None or tuple(a.shape) != t.shape:
            got = None if a is None else tuple(a.shape)
            raise FlowerAppError(f"the Flower client returned array {t.name} with shape {got}; "
                                 f"expected {t.shape} (as get_parameters gave)")
        out[off : off + t.numel] = a.reshape(-1)
    if not np.all(np.isfinite(out)):
        raise FlowerAppError("the Flower client returned non-finite parameters")
    return out


def unflatten_arrays(spec: ModelSpec, vector: FlatVector,
                     template: Sequence[npt.NDArray[Any]]) -> NDArrays:
    """Flower's parameter list for ``vector``: floating arrays from the vector in their own
    dtype, integer arrays copied from ``template`` (the client's local values)."""
    views = spec.unflatten(np.asarray(vector, dtype=np.float32))
    out: NDArrays = []
    for i, a in enumerate(template):
        name = f"p{i:03d}"
        if name in views:
            out.append(np.array(views[name], dtype=np.asarray(a).dtype, copy=True))
        else:
            out.append(np.array(a, copy=True))
    return out


def settings_config(settings: TaskSettings, seed: int, version: int | None = None
                    ) -> dict[str, bool | int | float | str]:
    """Murmura's task settings as a Flower ``config`` dict (Flower scalars only)."""
    config: dict[str, bool | int | float | str] = {
        "lr": float(settings.lr),
        "local_epochs": int(settings.local_epochs),
        "local_steps": int(settings.local_steps),
        "batch_size": int(settings.batch_size),
        "momentum": float(settings.momentum),
        "seed": int(seed % 2**63),
    }
    if version is not None:
        config["server-round"] = int(version) + 1  # Flower counts rounds from 1
    return config


# -- clients -------------------------------------------------------------------------------

class _Driver:
    """What the trainer needs from a Flower client: parameters and one fit."""

    def get_parameters(self) -> NDArrays:
        raise NotImplementedError

    def fit(self, arrays: NDArrays, config: dict[str, Any]) -> tuple[NDArrays, int,
                                                                      dict[str, Any]]:
        raise NotImplementedError

    def evaluate(self, arrays: NDArrays, config: dict[str, Any]
                 ) -> tuple[int, dict[str, float]] | None:
        """(num_examples, ``{"loss": ..., **metrics}``), or None when the client does not
        evaluate."""
        return None

    def query(self) -> dict[str, Scalar] | None:
        """The client's properties (Flower's ``get_properties``), or None without them."""
        return None


class _NumPyDriver(_Driver):
    def __init__(self, client: Any) -> None:
        self.client = client

    def get_parameters(self) -> NDArrays:
        return list(self.client.get_parameters(config={}))

    def fit(self, arrays: NDArrays, config: dict[str, Any]) -> tuple[NDArrays, int,
                                                                      dict[str, Any]]:
        reply = self.client.fit(arrays, config)
        if not (isinstance(reply, tuple) and len(reply) == 3):
            raise FlowerAppError("NumPyClient.fit must return (parameters, num_examples, "
                                 "metrics)")
        params, n, metrics = reply
        return list(params), int(n), dict(metrics or {})

    def evaluate(self, arrays: NDArrays, config: dict[str, Any]
                 ) -> tuple[int, dict[str, float]] | None:
        from flwr.client import NumPyClient

        if type(self.client).evaluate is NumPyClient.evaluate:  # not overridden
            return None
        loss, n, metrics = self.client.evaluate(arrays, config)
        return int(n), {"loss": float(loss), **_numeric(metrics)}

    def query(self) -> dict[str, Scalar] | None:
        from flwr.client import NumPyClient

        if type(self.client).get_properties is NumPyClient.get_properties:  # not overridden
            return None
        try:
            props = self.client.get_properties(dict(QUERY_CONFIG))
        except Exception as exc:
            raise FlowerAppError(f"the NumPyClient's get_properties failed: "
                                 f"{type(exc).__name__}: {str(exc)[:80]}") from exc
        return {str(k): v for k, v in dict(props or {}).items()
                if isinstance(v, bool | int | float | str)}


class _ClientAppDriver(_Driver):
    """A ``ClientApp(client_fn=...)``, driven by messages as a Flower SuperNode would."""

    def __init__(self, app: Any, context: Any) -> None:
        self.app, self.context = app, context
        self._count = 0

    def _send(self, content: Any, message_type: str) -> Any:
        import time

        from flwr.app import Message, Metadata

        # Metadata is given directly: outside a SuperNode no task identity is set, which a
        # Message built from dst_node_id and message_type alone would need.
        self._count += 1
        meta = Metadata(run_id=0, message_id=f"murmura-{self._count}", src_node_id=0,
                        dst_node_id=self.context.node_id, reply_to_message_id="",
                        group_id="", created_at=time.time(), ttl=3600.0,
                        message_type=message_type)
        try:
            make: Any = Message  # the metadata= form is missing from flwr's overloads
            reply = self.app(make(content=content, metadata=meta), self.context)
        except Exception as exc:
            raise FlowerAppError(f"the ClientApp failed a {message_type} message: "
                                 f"{type(exc).__name__}: {str(exc)[:80]}") from exc
        if reply.has_error():
            raise FlowerAppError(f"the ClientApp failed a {message_type} message: "
                                 f"{str(reply.error.reason)[:120]}")
        return reply.content

    def get_parameters(self) -> NDArrays:
        from flwr.common import GetParametersIns, parameters_to_ndarrays
        from flwr.compat.common.recorddict_compat import (
            getparametersins_to_recorddict,
            recorddict_to_getparametersres,
        )

        content = self._send(getparametersins_to_recorddict(GetParametersIns(config={})),
                             "get_parameters")
        res = recorddict_to_getparametersres(content, keep_input=False)
        return list(parameters_to_ndarrays(res.parameters))

    def query(self) -> dict[str, Scalar] | None:
        from flwr.common import Code, GetPropertiesIns
        from flwr.compat.common.recorddict_compat import (
            getpropertiesins_to_recorddict,
            recorddict_to_getpropertiesres,
        )

        content = self._send(getpropertiesins_to_recorddict(
            GetPropertiesIns(config=dict(QUERY_CONFIG))), "get_properties")
        res = recorddict_to_getpropertiesres(content)
        if res.status.code != Code.OK:  # the client does not implement get_properties
            return None
        return {str(k): v for k, v in dict(res.properties).items()
                if isinstance(v, bool | int | float | str)}

    def fit(self, arrays: NDArrays, config: dict[str, Any]) -> tuple[NDArrays, int,
                                                                      dict[str, Any]]:
        from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
        from flwr.compat.common.recorddict_compat import (
            fitins_to_recorddict,
            recorddict_to_fitres,
        )

        content = self._send(fitins_to_recorddict(
            FitIns(ndarrays_to_parameters(arrays), config), keep_input=False), "train")
        res = recorddict_to_fitres(content, keep_input=False)
        return list(parameters_to_ndarrays(res.parameters)), int(res.num_examples), \
            dict(res.metrics or {})


class FlowerTrainer(Trainer):
    """A Flower client as a Murmura :class:`Trainer` (see the module docstring)."""

    def __init__(self, driver: _Driver, template: NDArrays | None = None) -> None:
        self.driver = driver
        self._template = template if template is not None else driver.get_parameters()
        self.spec = spec_from_arrays(self._template)
        self._version: int | None = None
        self._last_eval: int | None = None
        #: Server settings the app's own config suggests (see :func:`app_defaults`).
        self.app_defaults: dict[str, Any] = {}
        #: The run config the app was given (its pyproject's, with overrides).
        self.run_config: dict[str, Any] = {}

    @classmethod
    def from_client(cls, client: Any) -> FlowerTrainer:
        """Wrap a ``NumPyClient`` (or the ``Client`` its ``to_client()`` gives)."""
        inner = _numpy_client(client)
        if inner is None:
            raise FlowerAppError(f"expected a Flower NumPyClient, got a {type(client).__name__}")
        return cls(_NumPyDriver(inner))

    def initial(self) -> FlatVector:
        """The client's own starting model as a flat vector (what a server can start from)."""
        return flatten_arrays(self.spec, self._template)

    def on_pull(self, version: int) -> None:
        self._version = version

    def query(self) -> dict[str, Scalar] | None:
        """The client's properties from its ``get_properties`` (a ``NumPyClient``, or a
        ``ClientApp(client_fn=...)`` sent a ``get_properties`` message), or None when it does
        not implement it."""
        return self.driver.query()

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        arrays = unflatten_arrays(self.spec, params, self._template)
        config = settings_config(settings, seed, self._version)
        report: dict[str, float] = {}
        every, version = settings.client_eval_every, self._version or 0
        if every and (self._last_eval is None or version // every > self._last_eval // every):
            # evaluation on the client (--client-eval-every): the global model, before
            # training, as the eval_* metrics the server folds (server/client_eval.py)
            evaluated = self.driver.evaluate(arrays, config)
            if evaluated is not None:
                ne, figures = evaluated
                report = {"eval_version": float(version), "eval_examples": float(max(ne, 1)),
                          **{k if k.startswith("eval_") else f"eval_{k}": v
                             for k, v in figures.items()}}
            self._last_eval = version
        new, n, metrics = self.driver.fit(arrays, config)
        if len(new) != len(self._template):
            raise FlowerAppError(f"the Flower client returned {len(new)} arrays; expected "
                                 f"{len(self._template)}")
        if n <= 0:
            raise FlowerAppError(f"the Flower client reported {n} training examples; "
                                 f"expected a positive number")
        # integer arrays stay local: keep what the client has now
        self._template = [b if f"p{i:03d}" not in self._names else a
                          for i, (a, b) in enumerate(zip(self._template, new, strict=True))]
        return TrainResult(flatten_arrays(self.spec, new), n, {**_numeric(metrics), **report})

    def evaluator(self) -> Any:
        """A server-side evaluator (flat vector -> metrics) from the client's ``evaluate``,
        or None when it has none: Murmura's metrics then carry no accuracy."""
        probe = self.driver.evaluate(self._template, {})
        if probe is None:
            return None

        def run(params: FlatVector) -> dict[str, float]:
            out = self.driver.evaluate(unflatten_arrays(self.spec, params, self._template), {})
            return dict(out[1]) if out is not None else {}
        return run

    @property
    def _names(self) -> set[str]:
        return {t.name for t in self.spec.tensors}


def _numeric(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The numeric entries of a Flower metrics dict (Murmura's metrics are floats)."""
    return {k: float(v) for k, v in (metrics or {}).items()
            if isinstance(v, int | float | np.number) and not isinstance(v, bool)}


def _numpy_client(obj: Any) -> Any:
    """The ``NumPyClient`` inside ``obj`` (itself, or a ``Client`` wrapping one), else None."""
    from flwr.client import NumPyClient

    if isinstance(obj, NumPyClient):
        return obj
    inner = getattr(obj, "numpy_client", None)  # NumPyClient.to_client() wraps it
    if isinstance(inner, NumPyClient):
        return inner
    return None


__all__ = ["FlowerAppError", "FlowerTrainer", "flatten_arrays", "settings_config",
           "spec_from_arrays", "unflatten_arrays"]
