"""Local training: turn the global model into a client's new model.

Two ways in, for two kinds of users:

* :class:`TorchTrainer` — give a ``torch.nn.Module``, data (arrays, a ``DataLoader`` or a
  function that builds one) and a loss; Murmura runs SGD with the server's settings.
* :class:`FunctionTrainer` — give ``train(model, settings, seed) -> metrics`` for full control.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from murmura.edge import amp_dtype, resolve_device
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


class TorchTrainer(Trainer):
    """Plain first-order local SGD on a torch module.

    ``data`` is an :class:`ArrayDataset` (batched here, shuffled from the task seed), a
    ``DataLoader``/iterable of ``(x, y)`` batches, or a zero-argument function returning one.

    ``amp`` picks mixed precision (:func:`murmura.edge.amp_dtype`): ``auto`` is bf16/fp16
    autocast on CUDA, where it is faster and stays within test tolerance of fp32, and fp32 on
    the CPU, so CPU runs stay bit-identical to the simulator's; fp16 uses a gradient scaler.
    ``micro_batch`` splits each batch into passes of that many rows with gradient accumulation
    (see :func:`murmura.edge.probe_micro_batch` for the largest that fits a memory cap).
    """

    def __init__(self, model: nn.Module, data: ArrayDataset | Iterable[Any] | Callable[[], Any],
                 *, loss_fn: LossFn = nn.functional.cross_entropy, device: str = "auto",
                 num_examples: int | None = None, weight_decay: float = 0.0,
                 amp: str = "auto", micro_batch: int = 0) -> None:
        self.device = resolve_device(device)
        self.amp_dtype = amp_dtype(self.device, amp)
        if micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0 (0: whole batches), got {micro_batch}")
        #: Rows per forward/backward pass; batches above it accumulate gradients (memory).
        self.micro_batch = micro_batch
        self.model = model.to(self.device)
        self.spec = ModelSpec.from_module(self.model)
        self.data = data
        self.loss_fn = loss_fn
        self.weight_decay = weight_decay
        self._num_examples = num_examples

    def num_examples(self) -> int:
        return count_examples(self.data, self._num_examples)

    def _backward(self, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None,
                  scaler: torch.amp.GradScaler) -> torch.Tensor:
        """Gradients of the batch's mean loss, in micro-batches of ``micro_batch`` rows when
        set (each micro-batch's loss weighted by its share of the batch: the same gradient
        for a mean-reduced loss and a model without batch statistics); returns the loss."""
        mb = self.micro_batch if self.micro_batch and len(y) > self.micro_batch else len(y)
        if mb == len(y) and amp is None:
            # One full-precision pass (the common CPU case): the same arithmetic as the loop
            # below, without its per-step split, autocast and accumulator overheads.
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss.detach().float()
        total = torch.zeros((), device=x.device)
        for xc, yc in zip(x.split(mb), y.split(mb), strict=True):
            with torch.autocast(self.device.type, dtype=amp or torch.float32,
                                enabled=amp is not None):
                loss = self.loss_fn(self.model(xc), yc)
            part = loss * (len(yc) / len(y)) if mb < len(y) else loss
            (scaler.scale(part) if amp is not None else part).backward()
            total += part.detach().float()
        return total

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        gen = _seed_everything(seed)
        self.spec.load_into(self.model, params)
        self.model.train()
        weights = list(self.model.parameters())
        opt = torch.optim.SGD(weights, lr=settings.lr,
                              momentum=settings.momentum, weight_decay=self.weight_decay)
        steps, loss_sum, seen = 0, 0.0, 0
        epochs = settings.local_epochs if settings.local_steps == 0 else 10**9
        amp = self.amp_dtype
        scaler = torch.amp.GradScaler(self.device.type, enabled=amp is torch.float16)
        for _ in range(epochs):
            for x, y in iter_batches(self.data, settings.batch_size, gen):
                x, y = x.to(self.device), y.to(self.device)
                for p in weights:  # opt.zero_grad(set_to_none=True), minus its profiler hooks
                    p.grad = None
                loss = self._backward(x, y, amp, scaler)
                if amp is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
                steps += 1
                loss_sum += float(loss.detach()) * len(y)
                seen += len(y)
                if settings.local_steps and steps >= settings.local_steps:
                    break
            if settings.local_steps and steps >= settings.local_steps:
                break
        if steps == 0:
            raise ValueError("the local data yielded no batch")
        return TrainResult(self.spec.flatten(self.model), self.num_examples(),
                           {"train_loss": loss_sum / max(seen, 1), "steps": float(steps)})


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
