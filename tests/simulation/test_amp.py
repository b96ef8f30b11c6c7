"""Mixed precision of simulated clients (``SimulationConfig.amp``): bfloat16 autocast in the
vectorised executor and the client's own trainer, float32 parameters, clear refusals.

bf16 autocast runs on the CPU too, so everything but the CUDA comparison runs everywhere; the
``gpu`` test is skipped without a CUDA device and uses no conftest fixture (a device script
runs it with ``--noconftest``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from murmura.protocols import ModelSpec, TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import (
    Job,
    LoopExecutor,
    SimulationConfig,
    VectorisedExecutor,
    simulate,
)
from murmura.simulation.config import ZO_AMP
from murmura.tasks import Task, TaskConfig, load_task
from tests.simulation.test_device import _max_update_diff

SETTINGS = TaskSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.9)
#: bf16 against float32: the largest difference of a client's update, relative to the update's
#: largest entry (measured: 0.03 for the digits MLP, 0.006 for gpt1m, on the CPU).
AMP_TOLERANCE = 0.1


@functools.cache
def _task(name: str, model: str) -> Task:
    return load_task(TaskConfig(task=name, model=model, partition="iid"))


def _jobs(task: Task, n: int) -> list[Job]:
    torch.manual_seed(0)
    model = task.model_factory()
    params = ModelSpec.from_module(model).flatten(model)
    return [Job(c, params, 100 + c) for c in range(n)]


@pytest.mark.parametrize("executor", ["vmap", "loop"])
def test_bf16_changes_the_arithmetic_but_not_the_update(executor: str) -> None:
    # Prepare: the digits MLP, six clients
    task = _task("digits", "mlp")
    shares = task.shares(20)[:6]
    jobs = _jobs(task, 6)
    make = VectorisedExecutor if executor == "vmap" else LoopExecutor
    # Execute
    full = make(task.model_factory, task.train, shares).run(jobs, SETTINGS)
    half = make(task.model_factory, task.train, shares, amp="bf16").run(jobs, SETTINGS)
    # Assert: autocast ran (the vectors differ), the updates agree within bf16 rounding, the
    # results stay float32 and report the same work
    start = jobs[0].params
    assert any(not np.array_equal(f.params, h.params) for f, h in zip(full, half, strict=True))
    assert _max_update_diff(full, half, start) <= AMP_TOLERANCE
    for f, h in zip(full, half, strict=True):
        assert h.params.dtype == np.float32
        assert h.num_examples == f.num_examples
        assert h.metrics["train_loss"] == pytest.approx(f.metrics["train_loss"], rel=1e-2)


def test_bf16_vmap_matches_the_bf16_trainer_on_a_language_model() -> None:
    # Prepare: gpt1m, three clients, two steps
    task = _task("lm", "gpt1m")
    shares = task.shares(200)[:3]
    settings = TaskSettings(local_epochs=0, local_steps=2, batch_size=4, lr=0.05)
    jobs = _jobs(task, 3)
    # Execute
    vec = VectorisedExecutor(task.model_factory, task.train, shares, amp="bf16")
    got = vec.run(jobs, settings)
    want = LoopExecutor(task.model_factory, task.train, shares, amp="bf16").run(jobs, settings)
    # Assert
    assert _max_update_diff(want, got, jobs[0].params) <= AMP_TOLERANCE
    assert "bf16 autocast" in vec.describe()


def test_the_probe_says_it_compared_within_bf16_rounding() -> None:
    task = _task("digits", "mlp")
    ex = VectorisedExecutor(task.model_factory, task.train, task.shares(4), amp="bf16")
    assert "within" in ex.probe(SETTINGS) and "bf16" in ex.probe(SETTINGS)


def test_a_simulation_with_bf16_learns_like_float32_and_says_so() -> None:
    # Prepare: the same run twice, float32 and bf16
    task = TaskConfig(task="digits", model="mlp", partition="iid")
    server = ServerConfig.from_flat(max_versions=4, round_deadline_s=1e9, seed=0,
                                    train=TaskSettings(local_epochs=1, batch_size=16, lr=0.1))
    runs = {amp: simulate(task, server, SimulationConfig(clients=20, amp=amp), out_dir=None)
            for amp in ("off", "bf16")}
    # Assert: both learn, within a few points of each other; the summary names the precision
    off, bf16 = runs["off"], runs["bf16"]
    assert off.final_accuracy is not None and bf16.final_accuracy is not None
    assert bf16.final_accuracy > 0.5
    assert abs(bf16.final_accuracy - off.final_accuracy) <= 0.05
    assert "bf16 autocast" in bf16.summary["simulation"]["execution"]
    assert "bf16" not in off.summary["simulation"]["execution"]


def test_bad_amp_settings_are_refused_with_what_works() -> None:
    with pytest.raises(ValueError, match="amp must be one of"):
        SimulationConfig(amp="fp16")
    with pytest.raises(ValueError, match="Ray executor trains in float32"):
        SimulationConfig(amp="bf16", executor="ray")
    with pytest.raises(ValueError, match="amp must be 'off' or 'bf16'"):
        task = _task("digits", "mlp")
        VectorisedExecutor(task.model_factory, task.train, task.shares(2), amp="fp8")


def test_zeroth_order_clients_refuse_bf16() -> None:
    task = TaskConfig(task="digits", model="mlp", partition="iid")
    server = ServerConfig.from_flat(max_versions=1, round_deadline_s=1e9, seed=0,
                                    train=TaskSettings(trainer="zo", codec="seed",
                                                       local_steps=2, local_epochs=0))
    with pytest.raises(ValueError, match="zero") as err:
        simulate(task, server, SimulationConfig(clients=4, amp="bf16"), out_dir=None)
    assert str(err.value) == ZO_AMP
    # the executor refuses it too, for callers that build one themselves
    t = _task("digits", "mlp")
    ex = VectorisedExecutor(t.model_factory, t.train, t.shares(2), amp="bf16")
    with pytest.raises(ValueError, match="zo_eps"):
        ex.run(_jobs(t, 2), server.train)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_cuda_matches_float32_on_the_cpu() -> None:
    task = _task("lm", "gpt1m")
    shares = task.shares(200)[:8]
    settings = TaskSettings(local_epochs=0, local_steps=2, batch_size=4, lr=0.05)
    jobs = _jobs(task, 8)
    cpu = VectorisedExecutor(task.model_factory, task.train, shares).run(jobs, settings)
    gpu = VectorisedExecutor(task.model_factory, task.train, shares, device="cuda",
                             amp="bf16").run(jobs, settings)
    assert _max_update_diff(cpu, gpu, jobs[0].params) <= AMP_TOLERANCE
