"""Bundled learning tasks: offline datasets, partitioners, small models and evaluation."""

from murmura.tasks.data import ArrayDataset, load_digits, make_synthetic, train_test_split
from murmura.tasks.lm import GPT, CharTokenizer, LMTask, evaluate_lm, generate_corpus, gpt
from murmura.tasks.models import evaluate, logistic_regression, mlp
from murmura.tasks.partition import PARTITIONERS, dirichlet, iid, partition, quantity_skew, shards
from murmura.tasks.registry import MODELS, TASK_MODELS, TASKS, Task, TaskConfig, load_task

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
