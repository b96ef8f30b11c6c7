"""Simulation on an accelerator: ``SimulationConfig.device``, the executors' device path, the
automatic chunk size, and what the summary records.

The CPU tests run everywhere. The tests marked ``gpu`` compare CUDA with the CPU and are
skipped without a CUDA device (``python -m pytest -m gpu tests/simulation/test_device.py`` on a
GPU machine). They use no conftest fixture: a device script may run them with
``--noconftest``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from murmura.protocols import ModelSpec, TaskSettings
from murmura.server import ServerConfig
from murmura.simulate import add_parser
from murmura.simulation import (
    Job,
    LoopExecutor,
    PoolExecutor,
    SimulationConfig,
    VectorisedExecutor,
    simulate,
)
from murmura.simulation.config import CPU_CHUNK, resolve_device
from murmura.simulation.data import load_simulation_data
from murmura.simulation.population import choose_executor
from murmura.simulation.ray_executor import actor_options
from murmura.tasks import ArrayDataset, Task, TaskConfig, load_task, logistic_regression, mlp

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

#: CUDA against the CPU: the largest difference between the two updates of a client, relative
#: to the largest entry of the CPU's update (TF32 off: float32 on both sides, reductions in
#: another order). With TF32 convolutions (cuDNN's default) expect about 1e-3 instead.
GPU_TOLERANCE = 1e-4

SETTINGS = TaskSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.9)


def _jobs(factory, n: int, seed: int = 0, steps: int = 0) -> list[Job]:
    torch.manual_seed(seed)
    model = factory()
    params = ModelSpec.from_module(model).flatten(model)
    return [Job(c, params, 1000 * seed + c, steps=steps) for c in range(n)]


def _stack(results) -> np.ndarray:
    return np.stack([r.params for r in results])


@functools.cache
def _task(name: str, model: str) -> Task:
    return load_task(TaskConfig(task=name, model=model, partition="dirichlet", alpha=0.5))


def _cnn() -> nn.Module:
    """A small CNN on the 8x8 digits (BatchNorm included: per-client statistics)."""
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 10))


# -- (a) the explicit CPU device path is the default path ------------------------------------


@pytest.mark.parametrize("factory", [lambda: logistic_regression(64, 10), lambda: mlp(64, 32, 10)],
                         ids=["logreg", "mlp"])
def test_vmap_with_device_cpu_is_bit_identical_to_the_default(digits: Task, factory) -> None:
    # Prepare: ragged Dirichlet shares, clients split over several chunks
    shares = digits.shares(10)
    jobs = _jobs(factory, 10)
    # Execute
    default = VectorisedExecutor(factory, digits.train, shares, chunk_size=4).run(jobs, SETTINGS)
    explicit = VectorisedExecutor(factory, digits.train, shares, chunk_size=4,
                                  device="cpu").run(jobs, SETTINGS)
    as_torch = VectorisedExecutor(factory, digits.train, shares, chunk_size=4,
                                  device=torch.device("cpu")).run(jobs, SETTINGS)
    # Assert
    assert _stack(explicit).tobytes() == _stack(default).tobytes()
    assert _stack(as_torch).tobytes() == _stack(default).tobytes()
    assert [r.metrics for r in explicit] == [r.metrics for r in default]
    assert all(r.params.dtype == np.float32 for r in explicit)


def test_jobs_from_several_global_vectors_keep_their_own_start(digits: Task) -> None:
    # Prepare: two global vectors (an async buffer mixes versions); each distinct vector is
    # uploaded once and repeated on the device
    factory = lambda: logistic_regression(64, 10)  # noqa: E731
    shares = digits.shares(6)
    a, b = _jobs(factory, 6, seed=1), _jobs(factory, 6, seed=2)
    mixed = [a[0], b[1], a[2], b[3], a[4], b[5]]
    ex = VectorisedExecutor(factory, digits.train, shares, device="cpu")
    # Execute
    together = ex.run(mixed, SETTINGS)
    apart = [ex.run([j], SETTINGS)[0] for j in mixed]
    # Assert
    for t, s in zip(together, apart, strict=True):
        np.testing.assert_allclose(t.params, s.params, rtol=0, atol=1e-6)


# -- (b) validation --------------------------------------------------------------------------


def test_an_unknown_device_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, cuda:N, mps, auto"):
        SimulationConfig(device="gpu")
    with pytest.raises(ValueError, match="device must be one of"):
        SimulationConfig(device="cuda:x")


def test_cuda_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            SimulationConfig(device=name)
    with pytest.raises(ValueError, match="CUDA is not available"):
        VectorisedExecutor(lambda: logistic_regression(4, 2),
                           ArrayDataset(np.zeros((4, 4), np.float32), np.zeros(4, np.int64)),
                           [np.arange(4)], device="cuda")


def test_auto_is_cuda_where_there_is_one_else_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")
    assert SimulationConfig(device="auto").device == "auto"  # resolved when executors are built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"


def test_a_missing_cuda_index_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert SimulationConfig(device="cuda:0").device == "cuda:0"
    with pytest.raises(ValueError, match="has 1 CUDA device"):
        SimulationConfig(device="cuda:3")


def test_the_pool_and_gossip_refuse_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="executor='pool' runs forked CPU processes"):
        SimulationConfig(executor="pool", device="cuda")
    with pytest.raises(ValueError, match="gossip simulations train on the CPU"):
        SimulationConfig(gossip=True, device="cuda")
    data = ArrayDataset(np.zeros((4, 4), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="process pool runs forked CPU processes"):
        PoolExecutor(lambda: logistic_regression(4, 2), data, [np.arange(4)], workers=2,
                     device="cuda")
    # auto with the pool: the pool stays on the CPU
    assert SimulationConfig(executor="pool", device="auto").executor == "pool"


def test_a_negative_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_size must be >= 1, or 0"):
        SimulationConfig(chunk_size=-1)


def test_ray_actors_share_the_gpus_evenly() -> None:
    cluster = {"CPU": 16.0, "GPU": 1.0}
    assert actor_options("cpu", 4, cluster) == (4, {"num_cpus": 1})
    assert actor_options("cpu", 0, cluster) == (16, {"num_cpus": 1})
    assert actor_options("cpu", 64, cluster) == (16, {"num_cpus": 1})  # one per CPU at most
    assert actor_options("cuda", 4, cluster) == (4, {"num_cpus": 1, "num_gpus": 0.25})
    assert actor_options("cuda", 0, cluster) == (1, {"num_cpus": 1, "num_gpus": 1.0})
    count, opts = actor_options("cuda", 3, cluster)
    assert count == 3 and opts["num_gpus"] == 0.3333 and 3 * opts["num_gpus"] <= 1
    assert actor_options("cuda:0", 2, {"CPU": 8.0, "GPU": 4.0}) == \
        (2, {"num_cpus": 1, "num_gpus": 1.0})
    assert actor_options("cuda", 0, {"CPU": 8.0, "GPU": 2.0})[0] == 2
    with pytest.raises(ValueError, match="has no GPUs"):
        actor_options("cuda", 2, {"CPU": 8.0})
    with pytest.raises(ValueError, match="not on 'mps'"):
        actor_options("mps", 2, cluster)


# -- (c) the chunk size: auto, and what reports it -------------------------------------------


def test_auto_chunk_size_on_the_cpu_is_the_default_and_described(digits: Task) -> None:
    factory = lambda: logistic_regression(64, 10)  # noqa: E731
    shares = digits.shares(5)
    ex = VectorisedExecutor(factory, digits.train, shares, chunk_size=0, device="cpu")
    assert ex.chunk_size == CPU_CHUNK == ex.chunk_for(SETTINGS)
    text = ex.describe()
    assert "vmap on cpu" in text and f"up to {CPU_CHUNK} clients" in text
    jobs = _jobs(factory, 5)
    fixed = VectorisedExecutor(factory, digits.train, shares).run(jobs, SETTINGS)
    assert _stack(ex.run(jobs, SETTINGS)).tobytes() == _stack(fixed).tobytes()


def test_the_per_client_footprint_counts_state_and_activations(digits: Task) -> None:
    ex = VectorisedExecutor(lambda: mlp(64, 32, 10), digits.train, digits.shares(3))
    state = 4 * ex.spec.size
    small, big = ex.client_footprint(8), ex.client_footprint(64)
    assert small > 5 * state  # parameters twice, gradients, momentum, temporaries, result row
    assert big > small  # activations and rows grow with the batch
    # the measurement moved no statistics and drew no random numbers of the run's
    before = torch.random.get_rng_state()
    ex.client_footprint(16)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_summary_records_the_device_and_the_chunk_size(tmp_path: Path) -> None:
    task = TaskConfig(task="digits", model="logreg", partition="iid")
    server = ServerConfig.from_flat(max_versions=2, seed=0,
                                    train=TaskSettings(local_epochs=1, batch_size=16, lr=0.1))
    sim = SimulationConfig(clients=6, chunk_size=0, device="cpu", vectorise="on",
                           out=str(tmp_path))
    result = simulate(task, server, sim)
    stats = json.loads((tmp_path / "summary.json").read_text())["simulation"]
    assert stats["device"] == "cpu" and stats["chunk_size"] == CPU_CHUNK
    assert "vmap on cpu" in stats["execution"] and str(CPU_CHUNK) in stats["execution"]
    assert result.summary["config"]["simulation"]["device"] == "cpu"


def test_choose_executor_passes_the_device_through() -> None:
    task = TaskConfig(task="digits", model="logreg", partition="iid")
    settings = TaskSettings(local_epochs=1, batch_size=16, lr=0.1)
    for sim, kind in ((SimulationConfig(clients=4, device="cpu", vectorise="off", workers=1),
                       LoopExecutor),
                      (SimulationConfig(clients=4, device="auto", executor="vmap"),
                       VectorisedExecutor)):
        data = load_simulation_data(task, sim)
        ex, _ = choose_executor(sim, data, settings)
        try:
            assert isinstance(ex, kind)
            assert ex.device_name.startswith(resolve_device(sim.device))
        finally:
            ex.close()


# -- (d) the command -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="murmura")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_murmura_simulate_device_cpu_writes_the_device_into_the_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a [simulation] table with the new keys, and the flag over it
    config = tmp_path / "run.toml"
    config.write_text('[task]\ntask = "digits"\nmodel = "logreg"\npartition = "iid"\n\n'
                      '[server]\nmax_versions = 2\nlocal_epochs = 1\n\n'
                      '[simulation]\nclients = 5\ndevice = "auto"\nchunk_size = 0\n')
    out = tmp_path / "out"
    args = _parser().parse_args(["simulate", "--config", str(config), "--out", str(out),
                                 "--device", "cpu", "-q"])
    # Execute
    rc = args.fn(args)
    # Assert
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["simulation"]["device"] == "cpu"  # the flag beats the file
    assert summary["config"]["simulation"]["chunk_size"] == 0  # asked: auto
    assert summary["simulation"]["device"] == "cpu"
    assert summary["simulation"]["chunk_size"] == CPU_CHUNK  # chosen
    assert "execution: vmap on cpu" in capsys.readouterr().out


def test_murmura_simulate_refuses_a_bad_device_flag() -> None:
    args = _parser().parse_args(["simulate", "--device", "tpu"])
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, cuda:N, mps, auto"):
        args.fn(args)


# -- (e) on a GPU --------------------------------------------------------------------------------


@pytest.fixture
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 matrix products and convolutions on the GPU, as on the CPU."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def _max_update_diff(cpu, gpu, start: np.ndarray) -> float:
    """Largest |CPU update - CUDA update| relative to the CPU update's largest entry."""
    worst = 0.0
    for c, g in zip(cpu, gpu, strict=True):
        du, dg = c.params - start, g.params - start
        worst = max(worst, float(np.abs(du - dg).max()) / max(float(np.abs(du).max()), 1e-12))
    return worst


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["logreg-synthetic", "mlp-digits", "cnn-digits"])
def test_cuda_updates_match_the_cpu(name: str, no_tf32: None) -> None:
    # Prepare
    task_name, model = {"logreg-synthetic": ("synthetic", "logreg"),
                        "mlp-digits": ("digits", "mlp"), "cnn-digits": ("digits", "mlp")}[name]
    task = _task(task_name, model)
    factory = _cnn if name == "cnn-digits" else task.model_factory
    shares = task.shares(24)
    jobs = _jobs(factory, 24)
    # Execute
    cpu = VectorisedExecutor(factory, task.train, shares, chunk_size=10).run(jobs, SETTINGS)
    ex = VectorisedExecutor(factory, task.train, shares, chunk_size=10, device="cuda")
    gpu = ex.run(jobs, SETTINGS)
    # Assert
    assert ex.device_name.startswith("cuda:") and "vmap on cuda" in ex.describe()
    assert all(g.params.dtype == np.float32 for g in gpu)
    assert _max_update_diff(cpu, gpu, jobs[0].params) <= GPU_TOLERANCE
    for c, g in zip(cpu, gpu, strict=True):
        assert g.num_examples == c.num_examples and g.metrics["steps"] == c.metrics["steps"]
        assert g.metrics["train_loss"] == pytest.approx(c.metrics["train_loss"], rel=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_cuda_gpt_updates_match_the_cpu(no_tf32: None) -> None:
    task = load_task(TaskConfig(task="lm", model="gpt1m", partition="iid"))
    shares = task.shares(200)[:3]
    settings = TaskSettings(local_epochs=0, local_steps=2, batch_size=4, lr=0.05)
    jobs = _jobs(task.model_factory, 3)
    cpu = VectorisedExecutor(task.model_factory, task.train, shares).run(jobs, settings)
    gpu = VectorisedExecutor(task.model_factory, task.train, shares,
                             device="cuda").run(jobs, settings)
    assert _max_update_diff(cpu, gpu, jobs[0].params) <= 10 * GPU_TOLERANCE


@pytest.mark.gpu
@needs_cuda
def test_auto_chunk_size_on_cuda_fits_the_free_memory() -> None:
    digits = _task("digits", "mlp")
    factory = lambda: mlp(64, 32, 10)  # noqa: E731
    ex = VectorisedExecutor(factory, digits.train, digits.shares(8), chunk_size=0,
                            device="cuda")
    assert ex.chunk_size == 0 and "sized automatically" in ex.describe()
    ex.probe(SETTINGS)
    free, _ = torch.cuda.mem_get_info()
    assert 1 <= ex.chunk_size <= 1 << 16
    assert ex.chunk_size * ex.client_footprint(SETTINGS.batch_size) <= free
    assert f"up to {ex.chunk_size} clients (auto" in ex.describe()


@pytest.mark.gpu
@needs_cuda
def test_a_zeroth_order_client_runs_on_cuda() -> None:
    digits = _task("digits", "mlp")
    zo = TaskSettings(trainer="zo", codec="seed", local_epochs=0, local_steps=10, lr=1e-3,
                      batch_size=16, zo_eps=1e-3)
    factory = digits.model_factory
    shares = digits.shares(3)
    jobs = _jobs(factory, 3)
    cpu = LoopExecutor(factory, digits.train, shares).run(jobs, zo)
    ex = LoopExecutor(factory, digits.train, shares, device="cuda")
    gpu = ex.run(jobs, zo)
    assert "loop on cuda" in ex.describe()
    for c, g in zip(cpu, gpu, strict=True):
        assert g.encoded is not None and g.encoded[0] == c.encoded[0]  # a seed step log
        assert np.isfinite(g.params).all()
        scale = max(float(np.abs(c.params - jobs[0].params).max()), 1e-12)
        assert float(np.abs(g.params - c.params).max()) / scale <= 1e-2


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_simulation_reaches_the_cpus_accuracy(tmp_path: Path) -> None:
    task = TaskConfig(task="synthetic", model="logreg", partition="dirichlet", alpha=0.5)
    server = ServerConfig.from_flat(max_versions=5, seed=0,
                                    train=TaskSettings(local_epochs=1, batch_size=16, lr=0.1,
                                                       momentum=0.5))
    runs = {}
    for device in ("cpu", "cuda"):
        sim = SimulationConfig(clients=40, device=device, chunk_size=0, vectorise="on",
                               out=str(tmp_path / device))
        runs[device] = simulate(task, server, sim)
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert gpu.summary["simulation"]["device"].startswith("cuda:")
    assert gpu.summary["simulation"]["chunk_size"] >= 1
    assert gpu.version == cpu.version == 5
    assert gpu.final_accuracy is not None and cpu.final_accuracy is not None
    assert abs(gpu.final_accuracy - cpu.final_accuracy) <= 0.01


def test_auto_chunks_that_run_out_of_memory_are_halved(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a device that holds 3 clients at a time (an out-of-memory error past that)
    digits = _task("digits", "mlp")
    factory = lambda: logistic_regression(64, 10)  # noqa: E731
    shares = digits.shares(10)
    jobs = _jobs(factory, 10)
    ex = VectorisedExecutor(factory, digits.train, shares, chunk_size=0)
    run_chunk = ex._run_chunk

    def small_device(chunk, settings):  # noqa: ANN001, ANN202
        if len(chunk) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return run_chunk(chunk, settings)

    monkeypatch.setattr(ex, "_run_chunk", small_device)
    # Execute
    got = ex.run(jobs, SETTINGS)
    # Assert: 10 -> 5 -> 2 clients per chunk, every client trained as in one big chunk
    assert ex.chunk_size == 2 and "after running out of memory" in ex.sizing
    want = VectorisedExecutor(factory, digits.train, shares).run(jobs, SETTINGS)
    np.testing.assert_allclose(_stack(got), _stack(want), rtol=0, atol=1e-6)
    # a chunk size asked for is kept: the error is the caller's
    fixed = VectorisedExecutor(factory, digits.train, shares, chunk_size=5)
    monkeypatch.setattr(fixed, "_run_chunk", small_device)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fixed.run(jobs, SETTINGS)


@pytest.mark.gpu
@needs_cuda
def test_the_loop_on_cuda_matches_the_cpu(no_tf32: None) -> None:
    digits = _task("digits", "mlp")
    shares = digits.shares(4)
    jobs = _jobs(digits.model_factory, 4)
    cpu = LoopExecutor(digits.model_factory, digits.train, shares).run(jobs, SETTINGS)
    ex = LoopExecutor(digits.model_factory, digits.train, shares, device="cuda")
    gpu = ex.run(jobs, SETTINGS)
    assert ex.device_name == "cuda" and "loop on cuda" in ex.describe()
    assert _max_update_diff(cpu, gpu, jobs[0].params) <= GPU_TOLERANCE
