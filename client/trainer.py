"""Local training: turn the global model into a client's new model.

Two ways in, for two kinds of users:

* :class:`~murmura.client.torch_trainer.TorchTrainer` — give a ``torch.nn.Module``, data
  (arrays, a ``DataLoader`` or a function that builds one) and a loss; Murmura runs SGD with
  the server's settings.
* :class:`FunctionTrainer` — give ``train(model, settings, seed) -> metrics`` for full control.

This module is what every trainer shares (the :class:`Trainer` interface and its
:class:`TrainResult`, seeding, batching and counting a client's data) and the function
trainer. It is kept apart from the first-order trainer's device machinery because most of
its users (the client runtime, the Flower adapter, the app and status trainers) need only
this contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from murmura.protocols import FlatVector, ModelSpec, TaskSettings
from murmura.tasks import ArrayDataset

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainResult:
    """A client's new local model (or its own encoding of the update) and what it measured."""

    params: FlatVector | None
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    #: (codec name, payload) for trainers that produce their own encoding (seed-based training)
    encoded: tuple[str, bytes] | None = None


class Trainer(ABC):
    spec: ModelSpec

    def on_pull(self, version: int) -> None:  # noqa: B027 - optional hook
        """Called with the global version about to be trained on (a leaf aggregator's link
        installs it for its own clients); plain trainers ignore it."""

    @abstractmethod
    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        """Start from ``params``, train locally, return the result.

        ``params`` is read, never modified: the runtime computes the update against it, and the
        simulation shares one vector between many clients.
        """


def _seed_everything(seed: int) -> torch.Generator:
    """Seed torch's global generators (dropout and other module randomness) and return a
    fresh generator for the batch order.

    Without an accelerator only the CPU generator is seeded: ``torch.manual_seed`` also
    queues a lazy seed for every accelerator backend, recording a Python stack trace each
    time, which cost about a tenth of a small model's local training in the simulator; with
    no accelerator available those queued seeds are never used, so the result is the same.
    """
    s = seed % (2**63)
    if torch.accelerator.is_available():
        torch.manual_seed(s)
    else:
        torch.default_generator.manual_seed(s)
    return torch.Generator().manual_seed(s)


def iter_batches(data: ArrayDataset | Iterable[Any] | Callable[[], Any], batch_size: int,
                 gen: torch.Generator) -> Iterator[Any]:
    """``(x, y)`` batches: arrays are shuffled by ``gen``; other data is iterated as given
    (a zero-argument callable is called first to build it)."""
    source: Any = data() if callable(data) and not isinstance(data, ArrayDataset) else data
    if isinstance(source, ArrayDataset):
        perm = torch.randperm(len(source), generator=gen).numpy()
        x, y = torch.from_numpy(source.x[perm]), torch.from_numpy(source.y[perm])
        for s in range(0, len(source), batch_size):
            yield x[s : s + batch_size], y[s : s + batch_size]
    else:
        yield from source


def count_examples(data: Any, override: int | None = None) -> int:
    """How many examples a client holds: ``override``, else the data's own length."""
    if override is not None:
        return override
    if isinstance(data, ArrayDataset):
        return len(data)
    try:
        return len(data.dataset)
    except (AttributeError, TypeError):
        raise ValueError("pass num_examples= for data whose size is unknown") from None


class FunctionTrainer(Trainer):
    """Full control: ``fn(model, settings, seed)`` trains ``model`` in place and returns metrics,
    which must include ``num_examples``."""

    def __init__(self, model: nn.Module,
                 fn: Callable[[nn.Module, TaskSettings, int], dict[str, float]]) -> None:
        self.model = model
        self.spec = ModelSpec.from_module(model)
        self.fn = fn

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        _seed_everything(seed)
        self.spec.load_into(self.model, params)
        metrics = dict(self.fn(self.model, settings, seed))
        n = metrics.pop("num_examples", None)
        if n is None or n <= 0:
            raise ValueError("the train function must return a positive 'num_examples'")
        return TrainResult(self.spec.flatten(self.model), int(n),
                           {k: float(v) for k, v in metrics.items()})


def delta_of(new: FlatVector, base: FlatVector) -> FlatVector:
    """The update a client sends: its trained model minus the global model it started from."""
    return np.subtract(new, base, dtype=np.float32)
