"""A client's trainer for any task or app, and evaluation on the client.

:func:`task_trainer` picks the trainer: an app's own ``train`` function, else Murmura's local
SGD (or zeroth-order, as the server's settings say) with the app's ``loss``.

:class:`EvaluatingTrainer` measures the global model a task starts from on the client's local
test split once every ``settings.client_eval_every`` versions, and reports the figures with
the update it pushes (``eval_version``, ``eval_examples``, ``eval_<metric>``), where the
server folds them into its metrics rows (server/client_eval.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from murmura.client.trainer import FunctionTrainer, Trainer, TrainResult, count_examples
from murmura.client.zo import SettingsTrainer, make_trainer
from murmura.protocols import FlatVector, TaskSettings
from murmura.tasks import Task
from murmura.tasks.app import AppError, AppTask, holdout

log = logging.getLogger(__name__)


class AppTrainer(FunctionTrainer):
    """Runs an app's ``train(model, data, settings, seed)`` on this client's data."""

    def __init__(self, task: AppTask, model: nn.Module, data: Any) -> None:
        train = task.app.fn("train")
        assert train is not None
        self.task, self.data = task, data
        super().__init__(model, lambda m, settings, seed: self._call(train, m, settings, seed))

    def _call(self, train: Callable[..., Any], model: nn.Module, settings: TaskSettings,
              seed: int) -> dict[str, float]:
        out = train(model, self.data, settings, seed)
        if not isinstance(out, dict):
            raise self.task.app.fail(f"train() must return a dict with num_examples, got "
                                     f"{type(out).__name__}")
        n = out.get("num_examples")
        if not isinstance(n, int | float) or n <= 0:
            raise self.task.app.fail("train() must return a positive 'num_examples' (how many "
                                     "examples this client trained on)")
        try:
            return {str(k): float(v) for k, v in out.items()}
        except (TypeError, ValueError):
            raise self.task.app.fail("train() must return numbers only") from None


def task_trainer(task: Task, data: Any, *, device: str = "auto", amp: str = "auto",
                 seed: int = 0) -> Trainer:
    """The trainer for ``task``'s client holding ``data`` (model initialised from ``seed``)."""
    model = task.build_model(seed=seed)
    if isinstance(task, AppTask) and task.app.fn("train") is not None:
        return AppTrainer(task, model, data)
    loss = task.app.fn("loss") if isinstance(task, AppTask) else None
    if loss is not None:
        return make_trainer(model, data, loss_fn=loss, device=device, amp=amp)
    return make_trainer(model, data, device=device, amp=amp)


def set_data(trainer: Trainer, data: Any) -> None:
    """Point ``trainer`` (and the trainers inside it) at new local training data."""
    if isinstance(trainer, SettingsTrainer):
        trainer.first_order.data = data
        trainer.zeroth_order.data = data
    elif hasattr(trainer, "data"):
        trainer.data = data
    else:
        raise TypeError(f"cannot give {type(trainer).__name__} new training data")


class EvaluatingTrainer(Trainer):
    """Wraps the trainer a client runs and evaluates on the client every N versions.

    The local test split is the app's ``client_test_data(index, num_clients)``; without one,
    a seeded fifth of the client's data is held out when the server first asks for
    evaluation, and the client trains on the rest from then on (with evaluation off the
    client trains on all of its data, as before).
    """

    def __init__(self, inner: Trainer, *, task: Task, base: Trainer, data: Any, index: int,
                 num_clients: int, seed: int = 0) -> None:
        self.inner, self.base, self.task = inner, base, task
        self.spec = inner.spec
        self.data, self.index, self.num_clients, self.seed = data, index, num_clients, seed
        self._test: Any = None
        self._decided = False
        self._model: nn.Module | None = None
        self._version = 0
        self._last: int | None = None

    def on_pull(self, version: int) -> None:
        self._version = version
        self.inner.on_pull(version)

    def test_split(self) -> Any:
        """The local test data (decided once; None if this client has none to spare)."""
        if not self._decided:
            self._decided = True
            own = self.task.client_test_data(self.index, self.num_clients)
            if own is not None:
                self._test = own
            else:
                split = holdout(self.data, seed=self.seed * 1_000_003 + self.index)
                if split is not None:
                    set_data(self.base, split[0])
                    self._test = split[1]
            if self._test is None:
                log.warning("client %d has no local test data to evaluate on (too little data, "
                            "or data that is not arrays and no client_test_data())", self.index)
        return self._test

    def evaluate(self, params: FlatVector) -> dict[str, float]:
        """The task's metrics of ``params`` on the local test split, as ``eval_*`` entries."""
        test = self.test_split()
        if self._model is None:
            self._model = self.task.build_model()
        self.spec.load_into(self._model, params)
        figures = self.task.evaluate(self._model, test)
        try:
            examples = len(test[1]) if isinstance(test, tuple) else count_examples(test)
        except (ValueError, TypeError, IndexError):
            examples = 1
        out = {"eval_version": float(self._version), "eval_examples": float(examples)}
        out.update({f"eval_{k}": float(v) for k, v in figures.items()})
        return out

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        every = settings.client_eval_every
        report: dict[str, float] = {}
        if every and self.test_split() is not None and (
                self._last is None or self._version // every > self._last // every):
            report = self.evaluate(params)  # the global model, before local training
            self._last = self._version
        result = self.inner.train(params, settings, seed=seed)
        if report:
            result.metrics.update(report)
        return result


def with_client_eval(running: Trainer, base: Trainer, task: Task, data: Any, *, index: int,
                     num_clients: int, seed: int = 0) -> EvaluatingTrainer:
    """``running`` (the trainer the runtime calls) with evaluation on the client; ``base`` is
    the trainer holding ``data`` (its training data shrinks if a test split is held out)."""
    return EvaluatingTrainer(running, task=task, base=base, data=data, index=index,
                             num_clients=num_clients, seed=seed)


__all__ = ["AppError", "AppTrainer", "EvaluatingTrainer", "set_data", "task_trainer",
           "with_client_eval"]
