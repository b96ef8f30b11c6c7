"""Which task to learn and how its data is split: :class:`TaskConfig` and the task and model
names, kept apart from the tasks themselves so that the command-line parser reads them
without loading torch (``murmura --help`` answers at once)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MODELS", "PARTITIONERS", "TASK_MODELS", "TaskConfig"]

#: The models each bundled task can build; the first is its default. The task loaders are
#: :data:`murmura.tasks.registry.TASKS`, one per key here.
TASK_MODELS: dict[str, tuple[str, ...]] = {
    "digits": ("mlp", "logreg"),
    "synthetic": ("mlp", "logreg"),
    "lm": ("gpt1m", "gpt10m", "gpt100m"),
}
MODELS = tuple(dict.fromkeys(m for models in TASK_MODELS.values() for m in models))
#: How client data can be split (:func:`murmura.tasks.partition.partition`).
PARTITIONERS = ("iid", "dirichlet", "shards", "quantity")


@dataclass(frozen=True)
class TaskConfig:
    """Which task to learn and how its data is split over clients."""

    task: str = "digits"
    #: "" (the default): the task's own default model, the first of its :data:`TASK_MODELS`;
    #: resolved when the config is built, so ``model`` always names a model afterwards.
    model: str = ""
    partition: str = "dirichlet"
    alpha: float = 0.5
    data_seed: int = 0
    app: str = field(default="", metadata={"help": (
        "an app FILE.py giving the model, each client's data, and optionally train, evaluate "
        "and aggregation rules; replaces --task and --model (docs/apps.md)")})

    def __post_init__(self) -> None:
        if self.app:  # import it now: a bad app fails before anything starts
            from murmura.tasks.app import load_app

            load_app(self.app)
        if self.task not in TASK_MODELS:
            raise ValueError(f"unknown task {self.task!r}; available: "
                             f"{', '.join(sorted(TASK_MODELS))}")
        if not self.model:
            object.__setattr__(self, "model", TASK_MODELS[self.task][0])
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; available: {', '.join(MODELS)}")
        if self.model not in TASK_MODELS[self.task]:
            raise ValueError(f"model {self.model!r} does not fit task {self.task!r}; "
                             f"use one of: {', '.join(TASK_MODELS[self.task])}")
        if self.partition not in PARTITIONERS:
            raise ValueError(f"unknown partition {self.partition!r}; "
                             f"available: {', '.join(PARTITIONERS)}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")
