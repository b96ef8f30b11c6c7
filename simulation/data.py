"""The data a simulation's clients hold: the task's data, scaled synthetic data, or a local
FEMNIST/CIFAR-10-style dataset read through flwr-datasets, split over clients.

Splits are index arrays into one shared training set, never copies: a client's only data
state is its index array. The task's partitioners (IID, Dirichlet label skew, shards,
quantity skew) apply to every source; :func:`natural` adds the per-writer split of datasets
that record who produced each example (FEMNIST's ``writer_id``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from murmura.simulation.config import SimulationConfig
from murmura.tasks import (
    ArrayDataset,
    Task,
    TaskConfig,
    load_task,
    logistic_regression,
    make_synthetic,
    mlp,
    partition,
    train_test_split,
)

log = logging.getLogger(__name__)

Index = npt.NDArray[np.int64]

#: Test examples generated next to ``samples_per_client`` synthetic training data.
SYNTHETIC_TEST_EXAMPLES = 2000
LABEL_COLUMNS = ("label", "labels", "character", "fine_label", "target")


def natural(groups: npt.ArrayLike, num_clients: int, *, seed: int) -> list[Index]:
    """Natural split: every example of one writer (group) goes to the same client.

    With as many clients as writers each client is one writer. With fewer clients, writers are
    shuffled (seeded) and dealt round-robin, so each client holds one or more whole writers.
    More clients than writers is an error: a writer's data is never cut.
    """
    groups = np.asarray(groups)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    writers, inverse = np.unique(groups, return_inverse=True)
    if num_clients > len(writers):
        raise ValueError(f"the data has {len(writers)} writers; a natural split cannot give "
                         f"{num_clients} clients one each")
    order = np.random.default_rng(seed).permutation(len(writers))
    client_of_writer = np.empty(len(writers), dtype=np.int64)
    client_of_writer[order] = np.arange(len(writers)) % num_clients
    owner = client_of_writer[inverse.reshape(-1)]
    by_client = np.argsort(owner, kind="stable")
    cuts = np.searchsorted(owner[by_client], np.arange(1, num_clients))
    return [np.sort(part).astype(np.int64) for part in np.split(by_client, cuts)]


@dataclass
class SimulationData:
    """A task (model factory, train and test data) and each client's index array."""

    task: Task
    shares: list[Index]
    source: str
    groups: npt.NDArray[Any] | None = field(default=None, repr=False)

    @property
    def train(self) -> ArrayDataset:
        return self.task.train

    def sizes(self) -> npt.NDArray[np.int64]:
        return np.fromiter((len(s) for s in self.shares), dtype=np.int64, count=len(self.shares))


def _factory(task_config: TaskConfig, features: int, classes: int) -> Any:
    if task_config.model not in ("mlp", "logreg"):  # the lm task's GPTs need its own data
        raise ValueError(f"model {task_config.model!r} needs the {task_config.task!r} task's "
                         "own data; a local or scaled data set trains mlp or logreg")
    if task_config.model == "mlp":
        return partial(mlp, features, 64, classes)
    return partial(logistic_regression, features, classes)


def load_simulation_data(task_config: TaskConfig, sim: SimulationConfig) -> SimulationData:
    """The data for ``sim.clients`` clients, as ``murmura run`` would split it.

    Without ``samples_per_client`` or ``data_path`` this is exactly the bundled task and its
    partition (so a simulation and a gRPC run of one config see the same shares).
    """
    n = sim.clients
    if sim.data_path:
        train, test, groups = load_local_dataset(sim.data_path, partition_by=sim.partition_by,
                                                 seed=task_config.data_seed)
        features, classes = train.x.shape[1], max(train.num_classes, test.num_classes)
        task = Task(task_config, train, test, _factory(task_config, features, classes))
        if sim.partition_by:
            assert groups is not None
            shares = natural(groups, n, seed=task_config.data_seed)
            source = f"{sim.data_path} (natural split by {sim.partition_by})"
        else:
            shares = _partition(train, n, task_config)
            source = f"{sim.data_path} ({task_config.partition} split)"
        return SimulationData(task, shares, source, groups)
    if sim.samples_per_client:
        if task_config.task != "synthetic":
            raise ValueError("samples_per_client applies to the synthetic task only; "
                             f"task {task_config.task!r} has a fixed size")
        total = n * sim.samples_per_client
        full = make_synthetic(num_examples=total + SYNTHETIC_TEST_EXAMPLES,
                              seed=task_config.data_seed)
        train = ArrayDataset(full.x[:total], full.y[:total])
        test = ArrayDataset(full.x[total:], full.y[total:])
        task = Task(task_config, train, test,
                    _factory(task_config, train.x.shape[1], full.num_classes))
        return SimulationData(task, _partition(train, n, task_config),
                              f"synthetic, {sim.samples_per_client} examples per client")
    task = load_task(task_config)
    return SimulationData(task, list(task.shares(n)), f"{task_config.task} (bundled)")


def _partition(train: ArrayDataset, n: int, cfg: TaskConfig) -> list[Index]:
    return partition(train.y, n, scheme=cfg.partition, seed=cfg.data_seed, alpha=cfg.alpha)


# -- local datasets through flwr-datasets --------------------------------------------------


def load_local_dataset(path: str | Path, *, partition_by: str = "", label_column: str = "",
                       feature_column: str = "", test_fraction: float = 0.2, seed: int = 0,
                       cache_dir: str | Path | None = None
                       ) -> tuple[ArrayDataset, ArrayDataset, npt.NDArray[Any] | None]:
    """Read a local image-classification dataset (FEMNIST, CIFAR-10 layout) into arrays.

    ``path`` is a directory written by ``datasets``' ``save_to_disk``, or a directory of
    parquet/CSV/JSON files, which is read through ``flwr_datasets.FederatedDataset``. Images
    become flat float32 rows in [0, 1]; the label column is ``label_column`` or the first of
    ``label``, ``character``, ... or a ``ClassLabel`` feature. When ``partition_by`` is set,
    that column (e.g. ``writer_id``) is returned for the training rows, for :func:`natural`.
    A dataset without a ``test`` split is split ``test_fraction`` by label (seeded).

    Only local data: nothing is downloaded (``HF_DATASETS_OFFLINE`` is set).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset path {path} does not exist (only local data is read)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("reading a local dataset needs flwr-datasets: "
                         "pip install flwr-datasets") from None
    splits = _read_splits(path, datasets, cache_dir)
    train_ds = splits["train"]
    label = label_column or _label_column(train_ds, datasets)
    feature = feature_column or _feature_column(train_ds, label, partition_by, datasets)
    if partition_by and partition_by not in train_ds.column_names:
        raise ValueError(f"dataset {path} has no column {partition_by!r}; columns: "
                         f"{', '.join(train_ds.column_names)}")
    train, groups = _to_arrays(train_ds, feature, label, partition_by)
    if "test" in splits:
        test, _ = _to_arrays(splits["test"], feature, label, "")
    else:
        train_idx, test_idx = _split_indices(train.y, test_fraction, seed)
        test = train.subset(test_idx)
        train = train.subset(train_idx)
        groups = groups[train_idx] if groups is not None else None
    return train, test, groups


def _read_splits(path: Path, datasets: Any, cache_dir: str | Path | None) -> dict[str, Any]:
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    try:
        from flwr_datasets import FederatedDataset
    except ImportError:
        raise ValueError("reading a dataset directory needs flwr-datasets: "
                         "pip install flwr-datasets") from None
    kwargs = {"cache_dir": str(cache_dir)} if cache_dir else {}
    fds = FederatedDataset(dataset=str(path), partitioners={"train": 1}, shuffle=False,
                           **kwargs)
    out = {"train": fds.load_split("train")}
    try:
        out["test"] = fds.load_split("test")
    except (KeyError, ValueError):  # no test split: load_local_dataset makes one
        pass
    return out


def _label_column(ds: Any, datasets: Any) -> str:
    for name in LABEL_COLUMNS:
        if name in ds.column_names:
            return name
    for name, feat in ds.features.items():
        if isinstance(feat, datasets.ClassLabel):
            return str(name)
    raise ValueError(f"no label column found among {ds.column_names}; pass label_column")


def _feature_column(ds: Any, label: str, partition_by: str, datasets: Any) -> str:
    for name, feat in ds.features.items():
        if isinstance(feat, datasets.Image):
            return str(name)
    rest = [c for c in ds.column_names if c not in (label, partition_by)]
    if len(rest) == 1:
        return rest[0]
    raise ValueError(f"no image column found among {ds.column_names}; pass feature_column")


def _to_arrays(ds: Any, feature: str, label: str, group: str
               ) -> tuple[ArrayDataset, npt.NDArray[Any] | None]:
    cols = [feature, label] + ([group] if group else [])
    batch = ds.select_columns(cols).with_format("numpy")[0:len(ds)]
    x = np.asarray(batch[feature])
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = (x.reshape(len(x), -1).astype(np.float32) / np.float32(scale))
    y = np.asarray(batch[label]).astype(np.int64)
    return ArrayDataset(np.ascontiguousarray(x), y), (np.asarray(batch[group]) if group else None)


def _split_indices(y: npt.NDArray[np.int64], test_fraction: float, seed: int
                   ) -> tuple[Index, Index]:
    tagged = ArrayDataset(np.arange(len(y), dtype=np.float32).reshape(-1, 1), y)
    train, test = train_test_split(tagged, test_fraction=test_fraction, seed=seed)
    return train.x[:, 0].astype(np.int64), test.x[:, 0].astype(np.int64)


__all__ = ["SimulationData", "load_local_dataset", "load_simulation_data", "natural"]
