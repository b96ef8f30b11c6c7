"""App files: a user's own model, data, training and evaluation in one Python module.

An app is what ``murmura run|server|client|simulate --app my_app.py`` loads instead of a
bundled task. It becomes an :class:`AppTask`, a :class:`~murmura.tasks.Task`, so the server,
the clients and the simulator use it the way they use the bundled tasks; the server and its
clients agree on it through the model spec's fingerprint, as for any task.

The module defines, at top level (docs/apps.md):

* ``model() -> torch.nn.Module`` (required): a fresh model; Murmura seeds torch around it.
* ``client_data(index, num_clients)`` (required): client ``index``'s training data, an
  :class:`~murmura.tasks.ArrayDataset` or an ``(x, y)`` pair of arrays/tensors (any data at all
  when the app defines ``train``).
* ``test_data()`` (optional): the server's evaluation data, same forms.
* ``client_test_data(index, num_clients)`` (optional): the client's local test split for client
  evaluation; without it a seeded fifth of the client's data is held out when evaluation is on.
* ``train(model, data, settings, seed) -> dict`` (optional): trains ``model`` in place on
  ``data`` and returns metrics including ``num_examples``; without it Murmura runs local SGD.
* ``evaluate(model, data) -> dict[str, float]`` (optional): default accuracy and loss.
* ``loss(output, target) -> Tensor`` (optional): the default trainer's loss (cross-entropy).

Aggregation rules are registered by name with ``@murmura.aggregation.aggregation_rule``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from murmura.tasks.data import ArrayDataset, train_test_split
from murmura.tasks.models import evaluate as default_evaluate
from murmura.tasks.registry import Task, TaskConfig

#: Share of a client's data held out as its local test split when the app gives none.
HOLDOUT_FRACTION = 0.2

REQUIRED = ("model", "client_data")
OPTIONAL = ("test_data", "client_test_data", "train", "evaluate", "loss")


class AppError(ValueError):
    """An app file is missing something or returned the wrong thing; says which and where."""


@dataclass
class App:
    """A loaded app file: its functions, checked to exist and be callable."""

    path: Path
    module: ModuleType = field(repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    def fn(self, name: str) -> Callable[..., Any] | None:
        value = getattr(self.module, name, None)
        return value if callable(value) else None

    def fail(self, what: str) -> AppError:
        return AppError(f"app {self.name}: {what}")

    def build_model(self) -> nn.Module:
        factory = self.fn("model")
        assert factory is not None  # checked at load
        made = factory()
        if not isinstance(made, nn.Module):
            raise self.fail(f"model() must return a torch.nn.Module, got {_kind(made)}")
        if not any(True for _ in made.parameters()):
            raise self.fail("model() returned a module without parameters")
        return made

    def arrays(self, value: Any, where: str, *, loose: bool = False) -> Any:
        """``value`` as an ArrayDataset; with ``loose`` (a custom train function) other data
        passes through unchanged."""
        if isinstance(value, ArrayDataset):
            return value
        if isinstance(value, tuple | list) and len(value) == 2:
            x, y = (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for v in value)
            if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
                if x.shape[:1] != y.shape[:1]:
                    raise self.fail(f"{where} gave {x.shape[0] if x.ndim else 0} inputs but "
                                    f"{y.shape[0] if y.ndim else 0} targets")
                y = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y
                return ArrayDataset(np.ascontiguousarray(x, dtype=np.float32), y)
        if loose and value is not None:
            return value
        raise self.fail(f"{where} must return an ArrayDataset or an (x, y) pair of arrays, "
                        f"got {_kind(value)}")

    def client_data(self, index: int, num_clients: int) -> Any:
        fn = self.fn("client_data")
        assert fn is not None
        data = fn(index, num_clients)
        if data is None:
            raise self.fail(f"client_data({index}, {num_clients}) returned None")
        if self.fn("train") is None:  # Murmura's trainer needs arrays; an app's own takes any
            data = self.arrays(data, "client_data()")
        if isinstance(data, ArrayDataset) and len(data) == 0:
            raise self.fail(f"client_data({index}, {num_clients}) returned no examples")
        return data

    def test_data(self) -> ArrayDataset | None:
        fn = self.fn("test_data")
        if fn is None:
            return None
        data = fn()
        return data if self.fn("evaluate") is not None else self.arrays(data, "test_data()")

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        fn = self.fn("evaluate")
        if fn is None:
            return default_evaluate(model, self.arrays(data, "the evaluation data"))
        with torch.no_grad():
            result = fn(model, data)
        if not isinstance(result, dict) or not result:
            raise self.fail(f"evaluate() must return a dict of metrics, e.g. "
                            f"{{'accuracy': 0.9}}, got {_kind(result)}"
                            + (" (a bare number does not say what it measures)"
                               if isinstance(result, int | float) else ""))
        try:
            return {str(k): float(v) for k, v in result.items()}
        except (TypeError, ValueError):
            raise self.fail("evaluate() must return numbers, e.g. {'accuracy': 0.9}") from None


def _kind(value: Any) -> str:
    return type(value).__name__


_LOADED: dict[Path, App] = {}
_LOCK = threading.Lock()


def load_app(path: str | Path) -> App:
    """Import the app file at ``path`` once per process and check what it defines.

    Importing runs the module, which registers its aggregation rules; a second call with the
    same file returns the same app (so rules are registered once).
    """
    resolved = Path(path).expanduser().resolve()
    with _LOCK:
        if resolved in _LOADED:
            return _LOADED[resolved]
        shown = str(path)[:80]
        if resolved.suffix != ".py":
            raise AppError(f"app {shown}: expected a Python file (.py)")
        if not resolved.is_file():
            raise AppError(f"app {shown}: no such file")
        digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
        module_name = f"murmura_app_{resolved.stem}_{digest}"
        spec = importlib.util.spec_from_file_location(module_name, resolved)
        if spec is None or spec.loader is None:
            raise AppError(f"app {shown}: cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # pickling and dataclasses look modules up here
        try:
            spec.loader.exec_module(module)
        except ValueError as exc:  # e.g. a rule name registered twice
            del sys.modules[module_name]
            raise AppError(f"app {resolved.name}: {exc}") from None
        except Exception as exc:
            del sys.modules[module_name]
            raise AppError(f"app {resolved.name}: importing it failed: "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        app = App(resolved, module)
        for name in REQUIRED:
            if not hasattr(module, name):
                raise app.fail(f"defines no {name}() (an app needs {' and '.join(REQUIRED)})")
        for name in (*REQUIRED, *OPTIONAL):
            if hasattr(module, name) and not callable(getattr(module, name)):
                raise app.fail(f"{name} must be a function, got {_kind(getattr(module, name))}")
        _LOADED[resolved] = app
        return app


EMPTY = ArrayDataset(np.zeros((0, 1), dtype=np.float32), np.zeros(0, dtype=np.int64))


class AppTask(Task):
    """An app as a task: what the server, the clients and the simulator ask a task for.

    ``train`` is empty until :meth:`shares` gathers every client's data into one set (the
    simulator's layout: index arrays into one training set); ``test`` is None when the app
    has no ``test_data()`` (the server then reports no accuracy of its own).
    """

    def __init__(self, config: TaskConfig, app: App) -> None:
        super().__init__(config, EMPTY, app.test_data(), app.build_model)  # type: ignore[arg-type]
        self.app = app

    def build_model(self, *, seed: int = 0) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.app.build_model()

    def client_data(self, index: int, num_clients: int) -> Any:
        if not 0 <= index < num_clients:
            raise ValueError(f"client index {index} is outside 0..{num_clients - 1}")
        return self.app.client_data(index, num_clients)

    def shares(self, num_clients: int) -> list[Any]:  # type: ignore[override]
        """Every client's data gathered into :attr:`train`; returns each client's rows."""
        if self._shares is not None and len(self._shares) == num_clients:
            return self._shares
        parts = [self.app.arrays(self.client_data(i, num_clients), "client_data()")
                 for i in range(num_clients)]
        shapes = {p.x.shape[1:] for p in parts}
        if len(shapes) != 1:
            raise self.app.fail(f"client_data() inputs differ in shape between clients: "
                                f"{sorted(shapes)[:3]}")
        self.train = ArrayDataset(np.concatenate([p.x for p in parts]),
                                  np.concatenate([p.y for p in parts]))
        ends = np.cumsum([len(p) for p in parts])
        self._shares = [np.arange(e - len(p), e, dtype=np.int64) for p, e in zip(parts, ends,
                                                                                    strict=True)]
        return self._shares

    def client_test_data(self, index: int, num_clients: int) -> Any:  # type: ignore[override]
        """The app's own local test split for client ``index``, or None."""
        fn = self.app.fn("client_test_data")
        if fn is None:
            return None
        data = fn(index, num_clients)
        if self.app.fn("evaluate") is not None:
            return data
        return self.app.arrays(data, "client_test_data()")

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:  # type: ignore[override]
        return self.app.evaluate(model, data)


def holdout(data: Any, *, seed: int, fraction: float = HOLDOUT_FRACTION
            ) -> tuple[Any, Any] | None:
    """A seeded split of a client's data into (train, local test), each of the data's own kind
    (an ArrayDataset, or an ``(x, y)`` pair of arrays or tensors); None when the data is of
    another kind or too small to spare an example."""
    pair = isinstance(data, tuple | list) and len(data) == 2
    tensors = pair and all(isinstance(v, torch.Tensor) for v in data)
    if pair and (tensors or all(isinstance(v, np.ndarray) for v in data)):
        x, y = (v.detach().cpu().numpy() if tensors else v for v in data)
        if len(x) != len(y):
            return None
        index = np.arange(len(y), dtype=np.float32).reshape(-1, 1)
        split = holdout(ArrayDataset(index, np.asarray(y).astype(np.int64)), seed=seed,
                        fraction=fraction)
        if split is None:
            return None
        rows: list[Any] = [s.x[:, 0].astype(np.int64) for s in split]
        if tensors:
            rows = [torch.from_numpy(r) for r in rows]
        return (data[0][rows[0]], data[1][rows[0]]), (data[0][rows[1]], data[1][rows[1]])
    if not isinstance(data, ArrayDataset) or len(data) < 2:
        return None
    train, test = train_test_split(data, test_fraction=fraction, seed=seed)
    if len(train) == 0 or len(test) == 0:
        return None
    return train, test


__all__ = ["HOLDOUT_FRACTION", "App", "AppError", "AppTask", "holdout", "load_app"]
