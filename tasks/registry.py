"""Named tasks: a model factory plus the data each client and the server evaluator use.

A task is what ``murmura run``/``server``/``client``/``simulate`` agree on by name, so a client
process can rebuild its own data share from (task, seed, partition) without any data moving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt
from torch import nn

from murmura.tasks import data as _data
from murmura.tasks import models as _models
from murmura.tasks.config import MODELS, TASK_MODELS, TaskConfig
from murmura.tasks.data import ArrayDataset
from murmura.tasks.partition import partition

__all__ = ["MODELS", "TASKS", "TASK_MODELS", "Task", "TaskConfig", "load_task"]


@dataclass
class Task:
    """Train/test data and a model factory, resolved from a :class:`TaskConfig`."""

    config: TaskConfig
    train: ArrayDataset
    test: ArrayDataset
    model_factory: Callable[[], nn.Module]
    _shares: list | None = field(default=None, repr=False)

    def build_model(self, *, seed: int = 0) -> nn.Module:
        return _models.seeded_init(self.model_factory, seed)

    def client_data(self, index: int, num_clients: int) -> ArrayDataset:
        """Client ``index``'s share of the training data (same split on every machine)."""
        if not 0 <= index < num_clients:
            raise ValueError(f"client index {index} is outside 0..{num_clients - 1}")
        return self.train.subset(self.shares(num_clients)[index])

    def client_test_data(self, index: int, num_clients: int) -> ArrayDataset | None:
        """A client's own local test split; bundled tasks have none (one is held out)."""
        return None

    def evaluate(self, model: nn.Module, data: ArrayDataset) -> dict[str, float]:
        return _models.evaluate(model, data)

    def shares(self, num_clients: int) -> list:
        if self._shares is None or len(self._shares) != num_clients:
            self._shares = partition(self.partition_labels(), num_clients,
                                     scheme=self.config.partition, seed=self.config.data_seed,
                                     alpha=self.config.alpha)
        return self._shares

    def partition_labels(self) -> npt.NDArray[np.int64]:
        """What the partition skews over: the training labels (the lm task: sources)."""
        return self.train.y


def _classifier(cfg: TaskConfig, train: ArrayDataset, test: ArrayDataset) -> Task:
    features, classes = train.x.shape[1], max(train.num_classes, test.num_classes)
    factory: Callable[[], nn.Module] = (
        partial(_models.mlp, features, 64, classes) if cfg.model == "mlp"
        else partial(_models.logistic_regression, features, classes)
    )
    return Task(cfg, train, test, factory)


def _digits(cfg: TaskConfig) -> Task:
    return _classifier(cfg, *_data.load_digits(seed=cfg.data_seed))


def _synthetic(cfg: TaskConfig) -> Task:
    full = _data.make_synthetic(num_examples=12_000, seed=cfg.data_seed)
    return _classifier(cfg, *_data.train_test_split(full, test_fraction=1 / 6,
                                                    seed=cfg.data_seed))


def _lm(cfg: TaskConfig) -> Task:
    from murmura.tasks.lm import load_lm_task  # here: murmura.tasks.lm imports this module

    return load_lm_task(cfg)


#: Bundled tasks by name: each builds its :class:`Task` from the config.
TASKS: dict[str, Callable[[TaskConfig], Task]] = {
    "digits": _digits,
    "synthetic": _synthetic,
    "lm": _lm,
}
def load_task(cfg: TaskConfig) -> Task:
    """The task ``cfg`` names: its app file if it gives one, else a bundled task."""
    if cfg.app:
        from murmura.tasks.app import AppTask, load_app

        return AppTask(cfg, load_app(cfg.app))
    return TASKS[cfg.task](cfg)
