"""The vectorised executor reproduces TorchTrainer client by client, within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from murmura.client import TorchTrainer
from murmura.protocols import ModelSpec, TaskSettings
from murmura.simulation import (
    Job,
    LoopExecutor,
    VectorisationError,
    VectorisedExecutor,
)
from murmura.simulation.vectorised import HostBlocks
from murmura.tasks import ArrayDataset, Task, logistic_regression, mlp

#: vmap reorders float additions inside batched matrix products; nothing else differs.
TOLERANCE = 1e-5


def _close(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1.0)


def _jobs(factory, n: int, seed: int = 0) -> list[Job]:
    model = factory()
    params = ModelSpec.from_module(model).flatten(model)
    return [Job(c, params, 1000 * seed + c) for c in range(n)]


@pytest.mark.parametrize("factory", [lambda: logistic_regression(64, 10), lambda: mlp(64, 32, 10)],
                         ids=["logreg", "mlp"])
@pytest.mark.parametrize("settings", [
    TaskSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.5),
    TaskSettings(local_steps=7, batch_size=8, lr=0.05, momentum=0.0),
    TaskSettings(local_epochs=1, batch_size=32, lr=0.2, momentum=0.9),
], ids=["epochs+momentum", "local-steps", "big-batch"])
def test_vmap_matches_the_trainer_for_every_client(digits: Task, factory, settings) -> None:
    # Prepare: Dirichlet shares, so clients have ragged batch counts and short last batches
    shares = digits.shares(12)
    jobs = _jobs(factory, 12)
    # Execute
    want = LoopExecutor(factory, digits.train, shares).run(jobs, settings)
    got = VectorisedExecutor(factory, digits.train, shares, chunk_size=5).run(jobs, settings)
    # Assert
    for w, g in zip(want, got, strict=True):
        assert _close(g.params, w.params) < TOLERANCE
        assert g.num_examples == w.num_examples
        assert g.metrics["steps"] == w.metrics["steps"]
        assert g.metrics["train_loss"] == pytest.approx(w.metrics["train_loss"], rel=1e-5)


def test_weight_decay_and_momentum_keep_inactive_clients_still(digits: Task) -> None:
    # Prepare: one client with a single batch next to one with many, weight decay on
    x, y = digits.train.x, digits.train.y
    shares = [np.arange(5), np.arange(5, 205)]
    settings = TaskSettings(local_epochs=1, batch_size=16, lr=0.1, momentum=0.9)
    factory = lambda: mlp(64, 16, 10)  # noqa: E731
    jobs = _jobs(factory, 2)
    # Execute
    got = VectorisedExecutor(factory, digits.train, shares, weight_decay=0.01).run(jobs, settings)
    # Assert: each equals a TorchTrainer with the same weight decay on its own data
    for job, g in zip(jobs, got, strict=True):
        trainer = TorchTrainer(factory(), ArrayDataset(x[shares[job.client]],
                                                       y[shares[job.client]]),
                               device="cpu", weight_decay=0.01)
        want = trainer.train(job.params, settings, seed=job.seed)
        assert _close(g.params, want.params) < TOLERANCE
    assert got[0].metrics["steps"] == 1.0 and got[1].metrics["steps"] == 13.0


def test_batchnorm_statistics_stay_per_client_and_match_the_trainer(digits: Task) -> None:
    # Prepare: BatchNorm running statistics are part of the flat vector
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))

    shares = [np.arange(0, 40), np.arange(40, 80), np.arange(80, 130)]  # two data sizes
    settings = TaskSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.5)
    jobs = _jobs(factory, 3)
    # Execute
    want = LoopExecutor(factory, digits.train, shares).run(jobs, settings)
    ex = VectorisedExecutor(factory, digits.train, shares)
    got = ex.run(jobs, settings)
    # Assert
    assert ex.batch_stats
    spec = ModelSpec.from_module(factory())
    for w, g in zip(want, got, strict=True):
        assert _close(g.params, w.params) < TOLERANCE
        stats = spec.unflatten(g.params)["1.running_mean"]
        assert np.abs(stats).sum() > 0  # the running mean moved
    means = [spec.unflatten(g.params)["1.running_mean"] for g in got]
    assert not np.allclose(means[0], means[1])  # each client has its own statistics


def test_dropout_draws_per_client_masks_reproducibly(digits: Task) -> None:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))

    shares = [np.arange(0, 64)] * 2  # two clients, same data, same start
    settings = TaskSettings(local_epochs=1, batch_size=16, lr=0.1, momentum=0.0)
    model = factory()
    params = ModelSpec.from_module(model).flatten(model)
    jobs = [Job(0, params, 5), Job(1, params, 5)]  # same seed: same batches
    ex = VectorisedExecutor(factory, digits.train, shares)
    a, b = ex.run(jobs, settings)
    again = ex.run(jobs, settings)
    assert not np.allclose(a.params, b.params)  # different dropout masks per client
    assert np.array_equal(a.params, again[0].params)  # but a rerun is identical
    assert "not compared" in ex.probe(settings)


def test_gradient_clipping_is_per_client(digits: Task) -> None:
    # Prepare: client 1's data is scaled up 1000x, so its gradients are huge
    x = digits.train.x.copy()
    x[64:128] *= 1000.0
    train = ArrayDataset(x, digits.train.y)
    shares = [np.arange(0, 64), np.arange(64, 128)]
    settings = TaskSettings(local_steps=1, batch_size=64, lr=0.5, momentum=0.0)
    factory = lambda: logistic_regression(64, 10)  # noqa: E731
    jobs = _jobs(factory, 2)
    clipped = VectorisedExecutor(factory, train, shares, max_grad_norm=0.1)
    # Execute
    both = clipped.run(jobs, settings)
    alone = clipped.run(jobs[:1], settings)
    free = VectorisedExecutor(factory, train, shares).run(jobs, settings)
    # Assert: each client's step is bounded by lr * max_norm, and the outlier does not
    # change the small client's clipping
    for r, job in zip(both, jobs, strict=True):
        assert np.linalg.norm(r.params - job.params) <= 0.5 * 0.1 * (1 + 1e-4)
    assert _close(both[0].params, alone[0].params) < 1e-6
    assert np.linalg.norm(free[1].params - jobs[1].params) > 10 * 0.05


def test_a_clients_result_does_not_depend_on_its_batch_mates(digits: Task) -> None:
    shares = digits.shares(12)
    factory = lambda: mlp(64, 32, 10)  # noqa: E731
    jobs = _jobs(factory, 12)
    settings = TaskSettings(local_epochs=1, batch_size=16, lr=0.1, momentum=0.5)
    ex = VectorisedExecutor(factory, digits.train, shares)
    together = ex.run(jobs, settings)
    for k in (0, 7):
        alone = ex.run([jobs[k]], settings)[0]
        assert _close(alone.params, together[k].params) < TOLERANCE


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) > 0 else -self.a(x)  # Python control flow on data


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x[:, :10]))


def test_models_vmap_cannot_run_are_refused(digits: Task) -> None:
    shares = digits.shares(4)
    settings = TaskSettings(local_epochs=1)
    with pytest.raises(VectorisationError):
        VectorisedExecutor(_DataDependent, digits.train, shares).probe(settings)
    with pytest.raises(VectorisationError, match="tied"):
        VectorisedExecutor(_Tied, digits.train, shares)


def test_vmap_trains_each_job_for_its_own_assigned_steps(digits: Task) -> None:
    # Prepare: FedCompass gives clients different step counts in one batch
    factory = lambda: mlp(64, 32, 10)  # noqa: E731
    shares = digits.shares(6)
    base = TaskSettings(local_steps=10, batch_size=8, lr=0.05, momentum=0.5)
    jobs = [Job(j.client, j.params, j.seed, steps=2 + 2 * j.client)
            for j in _jobs(factory, 6)]
    loop = LoopExecutor(factory, digits.train, shares)
    # Execute
    got = VectorisedExecutor(factory, digits.train, shares).run(jobs, base)
    # Assert: each equals the trainer run with local_steps = the job's steps
    for job, g in zip(jobs, got, strict=True):
        want = loop.run([Job(job.client, job.params, job.seed)],
                        TaskSettings(local_steps=job.steps, batch_size=8, lr=0.05,
                                     momentum=0.5))[0]
        assert g.metrics["steps"] == job.steps
        assert _close(g.params, want.params) < TOLERANCE


READ_BACK = TaskSettings(local_epochs=1, batch_size=16, lr=0.1)


def test_read_back_blocks_are_reused_only_once_no_result_holds_them(digits: Task) -> None:
    # Prepare: one executor, two rounds of the same six clients
    factory = lambda: logistic_regression(64, 10)  # noqa: E731
    ex = VectorisedExecutor(factory, digits.train, digits.shares(6), chunk_size=3)
    torch.manual_seed(0)
    model = factory()
    start = ModelSpec.from_module(model).flatten(model)
    jobs = [Job(c, start, c) for c in range(6)]
    # Execute: the first round's results are still held while the second round trains
    first = ex.run(jobs, READ_BACK)
    kept = [r.params.copy() for r in first]
    second = ex.run([Job(c, start, 100 + c) for c in range(6)], READ_BACK)
    # Assert: nothing of the first round was overwritten, the second round got new blocks
    assert all(np.array_equal(r.params, k) for r, k in zip(first, kept, strict=True))
    assert ex._host.reused == 0
    # once the first round's results are gone, its two blocks serve the next round
    del first, kept
    third = ex.run(jobs, READ_BACK)
    assert ex._host.reused == 2
    again = VectorisedExecutor(factory, digits.train, digits.shares(6), chunk_size=3)
    assert all(np.array_equal(a.params, b.params)
               for a, b in zip(third, again.run(jobs, READ_BACK), strict=True))
    del second


def test_host_blocks_hand_out_memory_no_view_holds() -> None:
    blocks = HostBlocks(pin=False)
    t, a = blocks.take(4, 5)
    a[:] = 1.0
    row = a[2]
    t2, b = blocks.take(4, 5)  # a view of the first survives: a new block
    assert not np.shares_memory(a, b) and blocks.reused == 0
    del row, a, t
    t3, c = blocks.take(3, 5)  # a smaller chunk fits the first block
    assert blocks.reused == 1 and c.shape == (3, 5) and c[0, 0] == 1.0
    assert t3.shape == (3, 5) and np.shares_memory(c, t3.numpy())
