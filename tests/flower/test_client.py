"""A Flower NumPyClient as a Murmura trainer: the adapter, and real training by a Murmura
server over gRPC on loopback."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.client import NumPyClient

from murmura.client import ClientConfig
from murmura.client.flower import FlowerAppError, FlowerTrainer
from murmura.client.flower_load import load_flower_client, run_flower_client
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, ServerThread
from murmura.server.flower import flower_core

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'examples' / 'flower_client.py'}:client_fn"

# examples/flower_client.py, which these tests run, reads scikit-learn's digits (dev extra).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                reason="examples/flower_client.py needs scikit-learn")


class Recording(NumPyClient):
    """Two float arrays and one integer array; fit adds 1 to the floats, records the config."""

    def __init__(self) -> None:
        self.arrays = [np.zeros((2, 3), np.float32), np.arange(4, dtype=np.float64),
                       np.array([7], np.int64)]
        self.configs: list[dict[str, Any]] = []

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [a.copy() for a in self.arrays]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        self.configs.append(dict(config))
        self.seen = [np.array(p) for p in parameters]
        out = [parameters[0] + 1, parameters[1] + 1, parameters[2] + 1]
        return out, 12, {"loss": 0.5, "note": "text is dropped"}


def test_spec_comes_from_float_arrays_and_settings_reach_the_config() -> None:
    client = Recording()
    trainer = FlowerTrainer.from_client(client)
    assert [(t.shape, t.dtype) for t in trainer.spec.tensors] == [((2, 3), "float32"),
                                                                  ((4,), "float64")]
    start = trainer.initial()
    np.testing.assert_array_equal(start, [0, 0, 0, 0, 0, 0, 0, 1, 2, 3])
    trainer.on_pull(4)
    result = trainer.train(start, TaskSettings(lr=0.05, local_epochs=2, batch_size=8), seed=9)
    assert client.configs == [{"lr": 0.05, "local_epochs": 2, "local_steps": 0,
                               "batch_size": 8, "momentum": 0.5, "seed": 9,
                               "server-round": 5}]
    assert client.seen[1].dtype == np.float64 and client.seen[2].tolist() == [7]
    np.testing.assert_array_equal(result.params, start + 1)
    assert result.num_examples == 12 and result.metrics == {"loss": 0.5}
    # the integer array stays local: the client's own new value is what it gets next time
    trainer.train(start, TaskSettings(), seed=0)
    assert client.seen[2].tolist() == [8]


def test_a_reply_of_the_wrong_shape_is_a_clear_error() -> None:
    client = Recording()
    trainer = FlowerTrainer.from_client(client)
    client.fit = lambda p, c: ([np.zeros(5, np.float32), p[1], p[2]], 3, {})  # type: ignore
    with pytest.raises(FlowerAppError, match=r"array p000 with shape \(5,\); expected \(2, 3\)"):
        trainer.train(trainer.initial(), TaskSettings(), seed=0)


def test_numpy_client_client_fn_and_client_app_train_alike() -> None:
    base = f"{ROOT / 'examples' / 'flower_client.py'}"
    results = []
    for attr in ("DigitsClient", "client_fn", "app"):
        trainer = load_flower_client(f"{base}:{attr}", client_index=0, num_clients=1)
        res = trainer.train(trainer.initial(), TaskSettings(lr=0.1, local_epochs=1,
                                                            batch_size=64), seed=3)
        results.append(res)
    assert results[0].num_examples == 1400
    for other in results[1:]:
        np.testing.assert_array_equal(other.params, results[0].params)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("server", [{"mode": "sync"},
                                    {"mode": "async", "buffer_size": 2, "defense": "median"}])
def test_a_murmura_server_trains_flower_clients_over_grpc(server: dict[str, Any],
                                                         tmp_path: Path) -> None:
    train = TaskSettings(lr=0.1, local_epochs=1, batch_size=32, momentum=0.0)
    cfg = ServerConfig.from_flat(max_versions=4, min_clients=2, workers=0, **server, train=train)
    core = flower_core(cfg, EXAMPLE, out_dir=tmp_path, durable=False)
    initial = core.evaluator(core.params.copy()) if core.evaluator else None
    assert initial is not None and initial["accuracy"] < 0.3
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            run_flower_client(ClientConfig(server=srv.address, client_index=i, num_clients=2,
                                           wait_s=1.0, give_up_after_s=60), EXAMPLE)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    srv = ServerThread(core, "127.0.0.1:0").start()
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert srv.wait_done(timeout=120)
        for t in threads:
            t.join(60)
        final = srv.call(lambda: dict(core.last_metrics))
    finally:
        srv.stop(grace=None)
    assert not errors, errors
    assert final["version"] == 4
    assert final["accuracy"] > initial["accuracy"] + 0.3


def test_a_message_api_client_app_without_a_serverapp_is_refused_with_a_hint() -> None:
    with pytest.raises(FlowerAppError, match=r"has no model of its own, and no pyproject.toml "
                                             r"with a serverapp"):
        load_flower_client(f"{ROOT / 'tests' / 'flower' / 'sim_apps.py'}:app")


def test_wrapping_something_else_is_a_clear_error() -> None:
    with pytest.raises(FlowerAppError, match="expected a Flower NumPyClient, got a dict"):
        FlowerTrainer.from_client({})
