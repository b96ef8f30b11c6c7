"""Bundled learning tasks: offline datasets, partitioners, small models and evaluation."""

import importlib
from typing import TYPE_CHECKING, Any

# The function shares its submodule's name, and importing the submodule would rebind the name
# to the module: bound here, as it always was (this loads numpy, not torch).
from murmura.tasks.partition import partition

if TYPE_CHECKING:
    from murmura.tasks.config import MODELS, TASK_MODELS, TaskConfig
    from murmura.tasks.data import ArrayDataset, load_digits, make_synthetic, train_test_split
    from murmura.tasks.lm import GPT, CharTokenizer, LMTask, evaluate_lm, generate_corpus, gpt
    from murmura.tasks.models import evaluate, logistic_regression, mlp
    from murmura.tasks.partition import (
        PARTITIONERS,
        dirichlet,
        iid,
        quantity_skew,
        shards,
    )
    from murmura.tasks.registry import TASKS, Task, load_task

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "ArrayDataset": "murmura.tasks.data",
    "load_digits": "murmura.tasks.data",
    "make_synthetic": "murmura.tasks.data",
    "train_test_split": "murmura.tasks.data",
    "GPT": "murmura.tasks.lm",
    "CharTokenizer": "murmura.tasks.lm",
    "LMTask": "murmura.tasks.lm",
    "evaluate_lm": "murmura.tasks.lm",
    "generate_corpus": "murmura.tasks.lm",
    "gpt": "murmura.tasks.lm",
    "evaluate": "murmura.tasks.models",
    "logistic_regression": "murmura.tasks.models",
    "mlp": "murmura.tasks.models",
    "PARTITIONERS": "murmura.tasks.config",
    "dirichlet": "murmura.tasks.partition",
    "iid": "murmura.tasks.partition",
    "quantity_skew": "murmura.tasks.partition",
    "shards": "murmura.tasks.partition",
    "MODELS": "murmura.tasks.config",
    "TASK_MODELS": "murmura.tasks.config",
    "TASKS": "murmura.tasks.registry",
    "Task": "murmura.tasks.registry",
    "TaskConfig": "murmura.tasks.config",
    "load_task": "murmura.tasks.registry",
}

__all__ = [
    "GPT",
    "MODELS",
    "PARTITIONERS",
    "TASKS",
    "TASK_MODELS",
    "ArrayDataset",
    "CharTokenizer",
    "LMTask",
    "Task",
    "TaskConfig",
    "dirichlet",
    "evaluate",
    "evaluate_lm",
    "generate_corpus",
    "gpt",
    "iid",
    "load_digits",
    "load_task",
    "logistic_regression",
    "make_synthetic",
    "mlp",
    "partition",
    "quantity_skew",
    "shards",
    "train_test_split",
]


def __getattr__(name: str) -> Any:
    """``package.Name`` and ``from package import Name``: import its module now."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
