"""The vectorised zeroth-order path: a chunk of clients takes the ZOTrainer's steps at once.

Each client's step log must name exactly the seeds its own trainer would draw (the server
replays the directions they name) with g values equal up to float32 rounding of the losses;
clients with fewer batches sit out the remaining steps; a simulation on the vmap executor
ends where the loop's does, to rounding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from murmura.client.zo import seed_codec_for
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import SimulationConfig, simulate
from murmura.simulation.execution import Job, LoopExecutor
from murmura.simulation.vectorised import VectorisationError, VectorisedExecutor
from murmura.tasks import TaskConfig, load_task

TASK = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
ZO = TaskSettings(trainer="zo", codec="seed", local_epochs=0, local_steps=6, lr=1e-3,
                  batch_size=16, zo_eps=1e-3)
#: sizes that give clients different numbers of batches (short last batches, idle steps)
SIZES = (40, 57, 23, 64, 9)
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def setup():
    task = load_task(TASK)
    rng = np.random.default_rng(0)
    shares = [np.sort(rng.choice(len(task.train), k, replace=False)) for k in SIZES]
    return task, shares


def _compare(got, want, settings: TaskSettings, jobs: list[Job]) -> None:
    codec = seed_codec_for(settings)
    for g, w, job in zip(got, want, jobs, strict=True):
        assert g.encoded is not None and w.encoded is not None
        assert g.encoded[0] == w.encoded[0] == "seed"
        a, b = codec.unpack(g.encoded[1]), codec.unpack(w.encoded[1])
        assert np.array_equal(a.seeds, b.seeds)  # the same directions, bit for bit
        assert a.lr == b.lr
        # g differs by the rounding of two float32 losses, then quantised for the wire: at
        # most one wire step apart (an int8 code, or a float16 ulp of |g| <= a few)
        # (int8: the step is set from the first |g|, so it differs by that rounding too, and
        # a code of up to 127 steps carries that difference 127 times)
        drift = abs(a.gscale - b.gscale)
        assert drift <= 1e-4
        quantum = 1.01 * max(a.gscale, b.gscale) + 127 * drift if a.gscale else 2e-3
        assert float(np.abs(a.grads - b.grads).max()) <= quantum + 1e-3
        assert g.num_examples == w.num_examples
        assert g.metrics["steps"] == w.metrics["steps"]
        assert g.metrics["train_loss"] == pytest.approx(w.metrics["train_loss"], rel=1e-5)
        moved = float(np.abs(w.params - job.params).max())
        assert moved > 0
        assert float(np.abs(g.params - w.params).max()) <= 1e-2 * moved


@pytest.mark.parametrize("settings", [
    ZO,
    dataclasses.replace(ZO, local_steps=0, local_epochs=2),           # ragged: idle steps
    dataclasses.replace(ZO, codec_options={"q": 2}),                  # two directions a batch
    dataclasses.replace(ZO, codec_options={"dtype": "int8"}),         # int8 g on the wire
], ids=["steps", "epochs", "q2", "int8"])
def test_vectorised_steps_are_the_trainers(setup, settings: TaskSettings) -> None:
    task, shares = setup
    vec = VectorisedExecutor(task.model_factory, task.train, shares)
    params = vec.spec.flatten(vec.model)
    jobs = [Job(c, params, 300 + c) for c in range(len(shares))]
    got = vec.run(jobs, settings)
    want = LoopExecutor(task.model_factory, task.train, shares).run(jobs, settings)
    _compare(got, want, settings, jobs)
    if settings.local_epochs:  # each client's log is as long as its own schedule
        q = seed_codec_for(settings).q
        codec = seed_codec_for(settings)
        for g, n in zip(got, SIZES, strict=True):
            batches = settings.local_epochs * -(-n // settings.batch_size)
            assert len(codec.unpack(g.encoded[1]).seeds) == batches * q


def test_server_assigned_steps_and_a_shared_seed_pool(setup) -> None:
    """FedCompass gives each task its own step count; FedKSeed draws steps from a pool."""
    task, shares = setup
    settings = dataclasses.replace(ZO, codec_options={"pool": 16}, seed=4)
    vec = VectorisedExecutor(task.model_factory, task.train, shares)
    params = vec.spec.flatten(vec.model)
    jobs = [Job(c, params, 50 + c, steps=2 + c) for c in range(len(shares))]
    got = vec.run(jobs, settings)
    loop = LoopExecutor(task.model_factory, task.train, shares)
    want = [loop.run([dataclasses.replace(j, steps=0)],
                     dataclasses.replace(settings, local_steps=j.steps))[0] for j in jobs]
    _compare(got, want, settings, jobs)
    pool = seed_codec_for(settings).pool(settings.seed)
    assert pool is not None
    for g in got:
        seeds = seed_codec_for(settings).unpack(g.encoded[1]).seeds
        assert set(seeds.tolist()) <= set(int(s) for s in pool.seeds)


def test_the_probe_checks_zeroth_order_steps(setup) -> None:
    task, shares = setup
    vec = VectorisedExecutor(task.model_factory, task.train, shares)
    assert vec.probe(ZO) == "probe matched the trainer"


def test_a_model_vmap_cannot_run_is_refused_when_vmap_is_asked_for() -> None:
    class Branchy(nn.Module):  # data-dependent control flow: vmap refuses .item()
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if float(x.sum().item()) > -1e9 else -self.fc(x)

    from murmura.simulation.data import SimulationData
    task = load_task(TASK)
    task = dataclasses.replace(task, model_factory=Branchy)
    rng = np.random.default_rng(0)
    shares = [np.sort(rng.choice(len(task.train), 30, replace=False)) for _ in range(2)]
    data = SimulationData(task, shares, "test shares")
    server = ServerConfig.from_flat(max_versions=1, seed=0, require_identity=False, train=ZO)
    with pytest.raises(ValueError, match="can't be vectorised"):
        simulate(TASK, server, SimulationConfig(clients=2, executor="vmap", out=None),
                 data=data, out_dir=None)
    with pytest.raises(VectorisationError):
        VectorisedExecutor(Branchy, task.train, shares).probe(ZO)


def test_a_vmap_simulation_ends_where_the_loops_does(tmp_path) -> None:
    server = ServerConfig.from_flat(max_versions=3, seed=2, require_identity=False,
                                    train=dataclasses.replace(ZO, local_steps=10, lr=2e-3))
    runs = {ex: simulate(TASK, server, SimulationConfig(clients=12, workers=1, executor=ex),
                         out_dir=None) for ex in ("loop", "vmap")}
    loop, vmap = runs["loop"], runs["vmap"]
    assert loop.execution_path == "loop" and vmap.execution_path == "vmap"
    # the same step counts, hence the same bytes on the wire
    assert [r["bytes_up"] for r in vmap.rows] == [r["bytes_up"] for r in loop.rows]
    diff = float(np.abs(vmap.params - loop.params).max())
    assert diff <= 3e-4 * float(np.abs(loop.params).max())  # measured: 2.5e-5 of it
    for a, b in zip(vmap.rows, loop.rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_vectorised_zeroth_order_steps_on_cuda_match_the_cpu(setup) -> None:
    task, shares = setup
    cpu = VectorisedExecutor(task.model_factory, task.train, shares)
    gpu = VectorisedExecutor(task.model_factory, task.train, shares, device="cuda")
    params = cpu.spec.flatten(cpu.model)
    jobs = [Job(c, params, 900 + c) for c in range(len(shares))]
    _compare(gpu.run(jobs, ZO), cpu.run(jobs, ZO), ZO, jobs)
