"""Trainers and the client loop against the real core through an in-test transport."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from murmura.client import ClientRuntime, FunctionTrainer, RemoteError, RetryPolicy, TorchTrainer
from murmura.protocols import ModelSpec, TaskSettings
from murmura.server import AggregatorCore, ServerConfig
from murmura.tasks import TaskConfig, load_task
from tests.client.core_transport import CoreTransport


def linear_trainer() -> FunctionTrainer:
    model = torch.nn.Linear(2, 1)

    def train(m, settings, seed):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        return {"num_examples": 4, "loss": 0.5}

    return FunctionTrainer(model, train)


def core_for(trainer, **cfg) -> AggregatorCore:
    cfg.setdefault("require_identity", False)  # legacy ids; tests/security covers identities
    return AggregatorCore(ServerConfig.from_flat(**cfg), trainer.spec,
                          trainer.spec.flatten(trainer.model))


def test_torch_trainer_learns_and_is_seeded() -> None:
    task = load_task(TaskConfig())
    trainer = TorchTrainer(task.build_model(), task.client_data(0, 2), device="cpu")
    p0 = trainer.spec.flatten(trainer.model)
    p0_bytes = p0.tobytes()
    s = TaskSettings(local_epochs=1)
    a = trainer.train(p0, s, seed=5)
    assert p0.tobytes() == p0_bytes  # the Trainer contract: params are read, never written
    b = trainer.train(p0, s, seed=5)
    c = trainer.train(p0, s, seed=6)
    assert a.params.tobytes() == b.params.tobytes() != c.params.tobytes()
    assert a.num_examples == len(task.client_data(0, 2)) and a.metrics["train_loss"] > 0
    steps = trainer.train(p0, TaskSettings(local_epochs=0, local_steps=3), seed=1)
    assert steps.metrics["steps"] == 3


def test_torch_trainer_matches_the_textbook_sgd_loop_bit_for_bit() -> None:
    """The trainer's CPU fast path (no split, no autocast, grads reset by hand) must give
    exactly what plain torch SGD gives on the same batches, dropout masks included: the
    simulator's results are compared across versions bit for bit."""
    task = load_task(TaskConfig())
    data = task.client_data(0, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(data.x.shape[1], 16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(16, 10))
    trainer = TorchTrainer(model, data, device="cpu")
    p0 = trainer.spec.flatten(trainer.model)
    s = TaskSettings(local_epochs=2, batch_size=8, lr=0.2, momentum=0.5)
    got = trainer.train(p0, s, seed=9)

    ref = torch.nn.Sequential(torch.nn.Linear(data.x.shape[1], 16), torch.nn.ReLU(),
                              torch.nn.Dropout(0.3), torch.nn.Linear(16, 10))
    trainer.spec.load_into(ref, p0)
    torch.manual_seed(9)
    gen = torch.Generator().manual_seed(9)
    opt = torch.optim.SGD(ref.parameters(), lr=s.lr, momentum=s.momentum)
    losses = []
    for _ in range(s.local_epochs):
        perm = torch.randperm(len(data), generator=gen).numpy()
        x, y = torch.from_numpy(data.x[perm]), torch.from_numpy(data.y[perm])
        for i in range(0, len(data), s.batch_size):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ref(x[i:i + s.batch_size]),
                                                     y[i:i + s.batch_size])
            loss.backward()
            opt.step()
            losses.append(float(loss) * len(y[i:i + s.batch_size]))
    assert got.params.tobytes() == trainer.spec.flatten(ref).tobytes()
    assert got.metrics["train_loss"] == sum(losses) / (s.local_epochs * len(data))
    assert got.metrics["steps"] == len(losses)
    # Dropout draws from the global generator the trainer seeds: another seed differs.
    assert trainer.train(p0, s, seed=10).params.tobytes() != got.params.tobytes()


def test_function_trainer_needs_num_examples() -> None:
    trainer = FunctionTrainer(torch.nn.Linear(2, 1), lambda m, s, seed: {"loss": 1.0})
    with pytest.raises(ValueError, match="num_examples"):
        trainer.train(np.zeros(3, np.float32), TaskSettings(), seed=0)


def test_runtime_trains_until_stop_and_leaves() -> None:
    trainer = linear_trainer()
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=3, min_clients=1)
    p0 = core.params.copy()
    rt = ClientRuntime(CoreTransport(core), trainer, client_id="c1", wait_s=0)
    stats = rt.run()
    assert stats.pushed == 3 and core.version == 3
    assert core.active_client_ids() == []  # it left
    np.testing.assert_allclose(core.params, p0 + 3.0, rtol=1e-6)  # each task adds 1


def test_runtime_backs_off_on_unavailable() -> None:
    trainer = linear_trainer()
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=2, min_clients=1)
    transport = CoreTransport(core)
    transport.failures = ["UNAVAILABLE", "UNAVAILABLE"]
    pauses: list[float] = []
    rt = ClientRuntime(transport, trainer, client_id="c1", wait_s=0, sleep=pauses.append,
                       retry=RetryPolicy(initial_s=0.1, max_s=1.0, jitter=0.0))
    stats = rt.run()
    assert pauses == [0.1, 0.2] and stats.retries == 2
    assert stats.pushed == 2 and core.version == 2


def test_runtime_rejoins_when_its_session_is_lost_mid_task() -> None:
    core_box: list[AggregatorCore] = []
    rt_box: list[ClientRuntime] = []
    model = torch.nn.Linear(2, 1)

    def train(m, settings, seed):
        if not rt_box[0].stats.rejoins:
            core_box[0].leave(rt_box[0].session)  # as if the server had restarted
        with torch.no_grad():
            m.weight.add_(1.0)
        return {"num_examples": 1}

    trainer = FunctionTrainer(model, train)
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=2, min_clients=1)
    core_box.append(core)
    rt = ClientRuntime(CoreTransport(core), trainer, client_id="c1", wait_s=0)
    rt_box.append(rt)
    stats = rt.run()
    assert stats.rejoins == 1 and stats.pushed == 2 and stats.refused == 0
    assert core.version == 2 and core.traffic.updates == 2


def test_runtime_gives_up_after_the_retry_budget() -> None:
    trainer = linear_trainer()
    core = core_for(trainer, mode="async", buffer_size=1, min_clients=1)
    transport = CoreTransport(core)
    transport.failures = ["UNAVAILABLE"] * 100
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    rt = ClientRuntime(transport, trainer, client_id="c1", sleep=sleep, clock=lambda: now[0],
                       retry=RetryPolicy(initial_s=1, max_s=4, give_up_after_s=20))
    with pytest.raises(RemoteError, match="UNAVAILABLE"):
        rt.run()


def test_refused_updates_are_counted_and_the_client_goes_on() -> None:
    trainer = linear_trainer()
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=2, min_clients=1)
    rt = ClientRuntime(CoreTransport(core), trainer, client_id="c1", wait_s=0,
                       update_hook=lambda u: np.full_like(u, np.nan))
    rt._call(rt._join)
    rt.step(0, seed=1)
    assert rt.stats.refused == 1 and rt.stats.refusals == ["INVALID_ARGUMENT"]
    rt.update_hook = None
    rt.step(0, seed=2)
    assert rt.stats.pushed == 1 and core.version == 1


def test_client_refuses_a_server_training_another_model() -> None:
    trainer = linear_trainer()
    other = FunctionTrainer(torch.nn.Linear(3, 1), lambda m, s, seed: {"num_examples": 1})
    core = core_for(other, min_clients=1)
    rt = ClientRuntime(CoreTransport(core), trainer, client_id="c1")
    with pytest.raises(ValueError, match="model spec"):
        rt.run()
    assert isinstance(trainer.spec, ModelSpec)
