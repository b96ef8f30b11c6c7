"""Client data: natural per-writer splits and local datasets read through flwr-datasets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import (
    SimulationConfig,
    load_local_dataset,
    load_simulation_data,
    natural,
    simulate,
)
from murmura.tasks import TaskConfig


def test_natural_split_keeps_every_writer_whole() -> None:
    writers = np.array(["w3", "w1", "w2", "w1", "w3", "w4", "w2", "w5"])
    for n in (1, 2, 5):
        shares = natural(writers, n, seed=0)
        assert len(shares) == n
        assert sorted(np.concatenate(shares).tolist()) == list(range(len(writers)))
        for share in shares:
            assert len(share) > 0
            for other in shares:
                if other is not share:
                    assert not set(writers[share]) & set(writers[other])
    again = natural(writers, 2, seed=0)
    first = natural(writers, 2, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    with pytest.raises(ValueError, match="5 writers"):
        natural(writers, 6, seed=0)


def test_synthetic_data_scales_with_the_number_of_clients() -> None:
    task = TaskConfig(task="synthetic", partition="iid")
    data = load_simulation_data(task, SimulationConfig(clients=300, samples_per_client=50))
    assert len(data.train) == 15_000 and data.sizes().tolist() == [50] * 300
    with pytest.raises(ValueError, match="synthetic task only"):
        load_simulation_data(TaskConfig(task="digits"),
                             SimulationConfig(clients=3, samples_per_client=5))


def _tiny_femnist(n: int = 120, writers: int = 6):
    datasets = pytest.importorskip("datasets", reason="flwr-datasets is an extra: "
                                   "pip install -e \".[data]\" (in dev)")
    pytest.importorskip("flwr_datasets", reason="flwr-datasets is an extra (data, in dev)")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=n)
    images = (rng.random((n, 28, 28)) * 60 + labels[:, None, None] * 40).astype(np.uint8)
    features = datasets.Features({"image": datasets.Image(),
                                  "writer_id": datasets.Value("string"),
                                  "character": datasets.ClassLabel(num_classes=62)})
    return datasets.Dataset.from_dict(
        {"image": list(images), "writer_id": [f"f{k % writers:04d}" for k in range(n)],
         "character": labels.tolist()}, features=features)


def test_a_local_femnist_style_dataset_loads_and_splits_by_writer(tmp_path: Path) -> None:
    # Prepare: a tiny dataset in both local layouts flwr-datasets/datasets read
    ds = _tiny_femnist()
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "parquet").mkdir()
    ds.to_parquet(str(tmp_path / "parquet" / "train.parquet"))
    for path in (tmp_path / "saved", tmp_path / "parquet"):
        # Execute
        train, test, writers = load_local_dataset(path, partition_by="writer_id",
                                                  cache_dir=tmp_path / "cache")
        # Assert
        assert train.x.shape[1] == 784 and train.x.dtype == np.float32
        assert 0.0 <= train.x.min() and train.x.max() <= 1.0
        assert len(train) + len(test) == 120 and len(test) > 0
        assert writers is not None and len(writers) == len(train)
        assert set(writers) == {f"f{k:04d}" for k in range(6)}


def test_a_simulation_runs_on_a_local_dataset_with_natural_clients(tmp_path: Path) -> None:
    ds = _tiny_femnist()
    ds.save_to_disk(str(tmp_path / "femnist"))
    sim = SimulationConfig(clients=6, data_path=str(tmp_path / "femnist"),
                           partition_by="writer_id")
    server = ServerConfig.from_flat(max_versions=2,
                                    train=TaskSettings(local_epochs=1, batch_size=8))
    task = TaskConfig(model="logreg")
    data = load_simulation_data(task, sim)
    assert all(len(set(data.groups[s])) == 1 for s in data.shares)  # one writer per client
    result = simulate(task, server, sim, data=data, out_dir=None)
    assert result.version == 2 and result.summary["simulation"]["data"].endswith(
        "(natural split by writer_id)")


def test_a_missing_dataset_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_local_dataset(tmp_path / "nope")


def test_client_eval_split_is_the_deployed_clients_hold_out() -> None:
    # Each virtual client's test split is what EvaluatingTrainer holds out of the same share
    # (seed data_seed * 1_000_003 + index), and it leaves the share the client trains on.
    from murmura.simulation.updates import split_for_client_eval
    from murmura.tasks.app import holdout

    task = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
    data = load_simulation_data(task, SimulationConfig(clients=5))
    split, tests = split_for_client_eval(data, seed=task.data_seed)
    for c, share in enumerate(data.shares):
        train_part, test_part = holdout(data.train.subset(share),
                                        seed=task.data_seed * 1_000_003 + c)
        assert np.array_equal(data.train.x[split.shares[c]], train_part.x)
        assert np.array_equal(tests[c].x, test_part.x)
        assert np.array_equal(tests[c].y, test_part.y)
        assert len(split.shares[c]) + len(tests[c]) == len(share)
    assert data.shares is not split.shares  # the caller's data is left as it was
