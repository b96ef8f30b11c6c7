"""Model buffers (BatchNorm running statistics) are averaged from the clients' values, never
stepped: the rule on small arrays through the real core, and an async BatchNorm simulation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from murmura.protocols import DeviceProfile, ModelSpec, TaskSettings, TensorSpec, UpdateHeader
from murmura.server import AggregatorCore, ServerConfig

SPEC = ModelSpec((TensorSpec("w", (2,)), TensorSpec("bn.running_mean", (2,), buffer=True),
                  TensorSpec("bn.running_var", (2,), buffer=True)))
P0 = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 1.0], np.float32)


def _core(**cfg: object) -> AggregatorCore:
    cfg = {"optimizer": "fedavgm", "server_lr": 2.0, **cfg}
    config = ServerConfig.from_flat(mode="async", buffer_size=2, max_staleness=5,
                                    require_identity=False, **cfg)
    return AggregatorCore(config, SPEC, P0)


def _push(core: AggregatorCore, session: str, delta: list[float], *, base: int, n: int,
          uid: str) -> None:
    payload = np.asarray(delta, "<f4").tobytes()
    core.push(UpdateHeader(session=session, update_id=uid, base_version=base, num_examples=n,
                           codec="dense-f32", payload_bytes=len(payload),
                           spec_fingerprint=core.fingerprint), payload)


def test_spec_marks_module_buffers_and_leaves_the_integer_count_out() -> None:
    spec = ModelSpec.from_module(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    marked = {t.name: t.buffer for t in spec.tensors}
    assert marked == {"0.weight": False, "0.bias": False, "1.weight": False, "1.bias": False,
                      "1.running_mean": True, "1.running_var": True}
    assert spec.variance_index.tolist() == [spec.size - 2, spec.size - 1]
    # the fingerprint ignores the mark: a spec read from the wire still matches
    assert spec.fingerprint() == ModelSpec(tuple(
        TensorSpec(t.name, t.shape, t.dtype) for t in spec.tensors)).fingerprint()


def test_server_lr_2_momentum_and_staleness_never_move_buffers() -> None:
    core = _core()
    a, b = (core.join(c, DeviceProfile()).session for c in ("a", "b"))
    # version 1: fresh updates; parameters step with lr 2 (momentum empty), buffers are the
    # examples-weighted mean of the clients' values (base + delta)
    _push(core, a, [1, 1, 1, 1, -0.8, -0.8], base=0, n=10, uid="a1")
    _push(core, b, [3, 3, 3, 3, -0.4, -0.4], base=0, n=30, uid="b1")
    assert core.version == 1
    mean = (10 * np.array([1, 1, 0.2, 0.2]) + 30 * np.array([3, 3, 0.6, 0.6])) / 40
    np.testing.assert_allclose(core.params[:2], 2 * 2.5, rtol=1e-6)
    np.testing.assert_allclose(core.params[2:], mean, rtol=1e-6)
    v1 = core.params.copy()
    # version 2: both updates trained on version 0 (stale): their deltas, added to version 1,
    # would overshoot (running_var 0.5 - 0.9 < 0); their values are 0.1 and 0.3
    _push(core, a, [0, 0, 0, 0, -0.9, -0.9], base=0, n=10, uid="a2")
    _push(core, b, [0, 0, 0, 0, -0.7, -0.7], base=0, n=10, uid="b2")
    assert core.version == 2
    np.testing.assert_allclose(core.params[2:4], 0.0, atol=1e-6)   # the clients' mean: 0
    np.testing.assert_allclose(core.params[4:], 0.2, rtol=1e-5)
    # parameters kept their momentum (0.9 x 2.5 with lr 2); buffers got none of it
    np.testing.assert_allclose(core.params[:2], v1[:2] + 2 * 0.9 * 2.5, rtol=1e-6)
    state = core.rule.checkpoint_state()[0]
    np.testing.assert_array_equal(state["momentum"][2:], 0.0)


BN_APP = '''
"""Blobs in 8 dimensions, far from the origin, and an MLP with BatchNorm."""
import numpy as np
from torch import nn


def model():
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _blobs(n, seed):
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).normal(0, 3.0, (4, 8))
    y = rng.integers(0, 4, n)
    x = rng.normal(0, 1.0, (n, 8)) * 4.0 + centres[y] * 4.0 + 10.0
    return x.astype(np.float32), y.astype(np.int64)


def client_data(index, num_clients):
    return _blobs(200, seed=100 + index)


def test_data():
    return _blobs(500, seed=7)
'''


def test_async_batchnorm_run_with_server_momentum_keeps_its_statistics(tmp_path: Path) -> None:
    """Async with server momentum (stale deltas stepped twice over) took running_var below
    zero: NaN loss and chance accuracy. Now the statistics stay the clients' own."""
    from murmura.simulation import SimulationConfig, simulate
    from murmura.tasks import TaskConfig, load_task

    app = tmp_path / "bn_app.py"
    app.write_text(BN_APP, encoding="utf-8")
    task = TaskConfig(app=str(app))
    server = ServerConfig.from_flat(mode="async", max_versions=30, buffer_size=4,
                                    min_clients=8, optimizer="fedavgm",
                                    train=TaskSettings(lr=0.05, local_epochs=1, batch_size=32))
    result = simulate(task, server, SimulationConfig(clients=8, speed_spread=10.0),
                      out_dir=None)
    assert result.version == 30
    assert all(np.isfinite(row["loss"]) for row in result.rows)
    assert min(row["accuracy"] for row in result.rows[5:]) > 0.8  # chance: 0.25
    model = load_task(task).build_model()
    spec = ModelSpec.from_module(model)
    assert (result.params[spec.variance_index] >= 0).all()
    spec.load_into(model, result.params)
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d) and bn.num_batches_tracked is not None
    assert bn.num_batches_tracked.dtype == torch.int64  # a count, never in the vector


@pytest.mark.parametrize("optimizer", ["fedadam", "fedyogi"])
def test_adaptive_optimizers_leave_buffers_to_the_mean(optimizer: str) -> None:
    core = _core(**{"optimizer": optimizer, "server_lr": 0.5})
    a, b = (core.join(c, DeviceProfile()).session for c in ("a", "b"))
    _push(core, a, [1, 1, 2, 2, -0.5, -0.5], base=0, n=10, uid="a1")
    _push(core, b, [1, 1, 4, 4, 0.5, 0.5], base=0, n=10, uid="b1")
    np.testing.assert_allclose(core.params[2:], [3, 3, 1, 1], rtol=1e-6)
