"""``executor = "ray"``: the loop executor on Ray actors, bit-identical to the loop, or
(``vectorise='on'``) vmapped chunks on the actors, equal to the vectorised path's results.

The Ray tests start a real local Ray (2 CPUs, a few seconds on a small machine) and shut it
down; they are skipped when Ray is not installed (``pip install "murmura[ray]"``).
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from murmura.cli import main
from murmura.protocols import ModelSpec, TaskSettings
from murmura.server import ServerConfig
from murmura.simulation import Job, LoopExecutor, SimulationConfig, simulate
from murmura.simulation.ray_executor import MISSING_RAY, RayExecutor
from murmura.tasks import Task, TaskConfig

TASK = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
SETTINGS = TaskSettings(local_epochs=1, batch_size=16, lr=0.1, momentum=0.9)


@pytest.mark.integration
@pytest.mark.slow
def test_a_ray_simulation_reaches_the_loops_model_and_stops_its_own_ray(tmp_path: Path) -> None:
    # Prepare: sync rounds fold updates in client-id order, so arrival order cannot matter
    ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e \".[ray]\" (in dev)")
    assert not ray.is_initialized(), "this test starts its own Ray; run it before the others"
    server = ServerConfig.from_flat(max_versions=2, seed=7, train=TaskSettings(local_epochs=1))

    def run(**kw):
        return simulate(TASK, server, SimulationConfig(clients=6, **kw), out_dir=None)

    # Execute
    loop = run(executor="loop")
    remote = run(executor="ray", workers=2)
    # Assert
    assert (loop.execution_path, remote.execution_path) == ("loop", "ray")
    assert "local Ray with 2 CPUs" in remote.summary["simulation"]["execution"]
    assert remote.version == loop.version == 2
    assert remote.params.tobytes() == loop.params.tobytes()
    assert [r["accuracy"] for r in remote.rows] == [r["accuracy"] for r in loop.rows]
    assert not ray.is_initialized()  # the local Ray it started is shut down by finish()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with 2 CPUs for the tests below, shut down after them (defined after the
    test above, which starts its own Ray and must find none running)."""
    ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e \".[ray]\" (in dev)")
    assert not ray.is_initialized(), "a previous test left Ray running"
    with warnings.catch_warnings():  # ray.init's tips about future defaults
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def _jobs(digits: Task, n: int) -> list[Job]:
    """Clients in scrambled order, from two different global vectors (as in async mode)."""
    model = digits.model_factory()
    first = ModelSpec.from_module(model).flatten(model)
    second = first + np.float32(0.01)
    order = [7, 2, 9, 0, 11, 4, 1, 10, 3, 8, 5, 6][:n]
    return [Job(c, first if k % 3 else second, 500 + 13 * c) for k, c in enumerate(order)]


@pytest.mark.integration
@pytest.mark.slow
def test_ray_training_is_bit_identical_to_the_loop(digits: Task, local_ray) -> None:
    # Prepare: Dirichlet shares, so clients hold different amounts of data
    shares = digits.shares(12)
    jobs = _jobs(digits, 12)
    want = LoopExecutor(digits.model_factory, digits.train, shares).run(jobs, SETTINGS)
    ex = RayExecutor(digits.model_factory, digits.train, shares)
    try:
        for jobs_per_task in (0, 5):  # automatic (2 per task here), and a short last task
            ex.jobs_per_task = jobs_per_task
            # Execute
            got = ex.run(jobs, SETTINGS)
            # Assert: same models, counts and metrics, in the order of the jobs
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.params.tobytes() == w.params.tobytes()
                assert g.num_examples == w.num_examples
                assert g.metrics == w.metrics
                assert g.params.flags.writeable
    finally:
        ex.close()
    assert ex.workers == 2 and ex.path == "ray"
    # the executor used the Ray this process had started, and left it running
    assert local_ray.is_initialized()


@pytest.mark.integration
@pytest.mark.slow
def test_vectorised_ray_actors_train_what_the_vectorised_executor_trains(
        digits: Task, local_ray) -> None:
    """Each actor trains its share of the batch as vmapped chunks: per client, what the
    local vectorised executor gives (a client's result does not depend on its chunk)."""
    from murmura.simulation.vectorised import VectorisedExecutor

    shares = digits.shares(12)
    jobs = _jobs(digits, 12)
    want = VectorisedExecutor(digits.model_factory, digits.train, shares).run(jobs, SETTINGS)
    ex = RayExecutor(digits.model_factory, digits.train, shares, vectorise=True, chunk_size=4)
    try:
        got = ex.run(jobs, SETTINGS)
    finally:
        ex.close()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.params, w.params, rtol=1e-5, atol=1e-6)
        assert g.num_examples == w.num_examples
        assert g.metrics["steps"] == w.metrics["steps"]
    assert "vmapped chunks of up to 4 clients" in ex.describe()


@pytest.mark.integration
@pytest.mark.slow
def test_a_vectorised_ray_simulation_reaches_the_vmap_runs_model(local_ray) -> None:
    server = ServerConfig.from_flat(max_versions=2, seed=5, train=TaskSettings(local_epochs=1))

    def run(**kw):
        return simulate(TASK, server, SimulationConfig(clients=6, **kw), out_dir=None)

    vmap = run(executor="vmap")
    remote = run(executor="ray", vectorise="on", workers=2)
    assert remote.execution_path == "ray"
    assert "vmapped chunks" in remote.summary["simulation"]["execution"]
    assert "probe matched the trainer" in remote.summary["simulation"]["probe"]
    np.testing.assert_allclose(remote.params, vmap.params, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.slow
def test_more_workers_than_cpus_start_one_actor_per_cpu(
        digits: Task, local_ray, caplog: pytest.LogCaptureFixture) -> None:
    # Execute
    with caplog.at_level(logging.WARNING, logger="murmura.simulation.ray_executor"):
        ex = RayExecutor(digits.model_factory, digits.train, digits.shares(4), workers=5)
    ex.close()
    # Assert: 5 actors of 1 CPU on 2 CPUs would wait forever for a place
    assert ex.workers == 2
    assert "workers=5" in caplog.text and "starting 2 actors" in caplog.text


def test_without_ray_the_executor_says_how_to_install_it(
        digits: Task, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: `import ray` fails as it does where Ray is not installed
    monkeypatch.setitem(sys.modules, "ray", None)
    # Execute / Assert
    with pytest.raises(ValueError, match=re.escape(MISSING_RAY)):
        RayExecutor(digits.model_factory, digits.train, digits.shares(4))


def test_without_ray_the_cli_prints_one_line_and_no_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    monkeypatch.setitem(sys.modules, "ray", None)
    # Execute
    rc = main(["simulate", "--executor", "ray", "--clients", "2", "--max-versions", "1",
               "--out", str(tmp_path), "-q"])
    # Assert
    err = capsys.readouterr().err
    assert rc == 2
    assert f"murmura simulate: {MISSING_RAY}" in err.splitlines()
    assert "Traceback" not in err


def test_the_executor_flags_appear_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "--executor EXECUTOR" in out and "--ray-address RAY_ADDRESS" in out


@pytest.mark.parametrize("kwargs,message", [
    ({"executor": "spark"}, "executor must be one of"),
    ({"executor": "vmap", "vectorise": "off"}, "contradicts vectorise='off'"),
    ({"executor": "loop", "vectorise": "on"}, "contradicts vectorise='on'"),
    ({"executor": "pool", "workers": 1}, "needs workers >= 2"),
    ({"ray_address": "auto"}, "only used with executor='ray'"),
    ({"executor": "ray", "ray_address": "head node:6379"}, "must be an address"),
])
def test_executor_settings_that_contradict_each_other_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SimulationConfig(**kwargs)


def test_the_named_executors_are_the_ones_that_run(digits: Task) -> None:
    # Prepare: a model vmap can run; naming loop still runs the loop
    server = ServerConfig.from_flat(max_versions=1, seed=3, train=TaskSettings(local_epochs=1))
    # Execute
    loop = simulate(TASK, server, SimulationConfig(clients=3, executor="loop"), out_dir=None)
    vmap = simulate(TASK, server, SimulationConfig(clients=3, executor="vmap"), out_dir=None)
    # Assert
    assert (loop.execution_path, vmap.execution_path) == ("loop", "vmap")
    assert loop.summary["simulation"]["probe"] == "executor='loop'"
