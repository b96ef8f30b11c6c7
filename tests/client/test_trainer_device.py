"""TorchTrainer on its device: data placement, batches, one read of the losses, CUDA paths.

The trainer is imported from ``murmura.client.torch_trainer`` (not ``murmura.client``) so that this
file also runs where the client runtime's dependencies are missing, e.g. on a bare GPU machine
with the benchmark's import shim (``-p benchmarks.zo_speed``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from murmura.client import torch_trainer as trainer_module
from murmura.client.cuda_graph import GRAPH_MIN_REPLAYS, GRAPH_WARMUP, full_batches
from murmura.client.placement import RESIDENT_FRACTION, data_placement
from murmura.client.torch_trainer import TorchTrainer
from murmura.client.trainer import _seed_everything, iter_batches
from murmura.protocols import TaskSettings
from murmura.tasks import ArrayDataset

HAS_CUDA = torch.cuda.is_available()


def make_data(n: int = 70, features: int = 12, classes: int = 5, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.normal(size=(n, features)).astype(np.float32),
                        rng.integers(0, classes, n).astype(np.int64))


def make_model(features: int = 12, classes: int = 5, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(features, 32), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, classes)]
    return nn.Sequential(*layers)


def previous_train(trainer: TorchTrainer, params: np.ndarray, settings: TaskSettings,
                   seed: int) -> tuple[np.ndarray, dict[str, float]]:
    """TorchTrainer.train as it was before data placement and the device loss log: batches
    from iter_batches, each moved with ``.to``, the loss read as a Python float per step."""
    gen = _seed_everything(seed)
    trainer.spec.load_into(trainer.model, params)
    trainer.model.train()
    weights = list(trainer.model.parameters())
    opt = torch.optim.SGD(weights, lr=settings.lr, momentum=settings.momentum,
                          weight_decay=trainer.weight_decay)
    steps, loss_sum, seen = 0, 0.0, 0
    epochs = settings.local_epochs if settings.local_steps == 0 else 10**9
    amp = trainer.amp_dtype
    scaler = torch.amp.GradScaler(trainer.device.type, enabled=amp is torch.float16)
    for _ in range(epochs):
        for x, y in iter_batches(trainer.data, settings.batch_size, gen):
            x, y = x.to(trainer.device), y.to(trainer.device)
            for p in weights:
                p.grad = None
            loss = trainer._backward(x, y, amp, scaler)
            if amp is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            steps += 1
            loss_sum += float(loss.detach()) * len(y)
            seen += len(y)
            if settings.local_steps and steps >= settings.local_steps:
                break
        if settings.local_steps and steps >= settings.local_steps:
            break
    return (trainer.spec.flatten(trainer.model),
            {"train_loss": loss_sum / max(seen, 1), "steps": float(steps)})


SETTINGS = {
    "epochs, short last batch": TaskSettings(local_epochs=2, batch_size=16, lr=0.1,
                                             momentum=0.5),
    "steps across epochs": TaskSettings(local_epochs=0, local_steps=11, batch_size=32, lr=0.05,
                                        momentum=0.9),
    "one example per batch": TaskSettings(local_epochs=1, batch_size=1, lr=0.01, momentum=0.0),
}


# -- determinism and equality with the previous trainer on the CPU ---------------------------


@pytest.mark.parametrize("name", list(SETTINGS))
def test_same_seed_gives_identical_params_and_metrics(name: str) -> None:
    trainer = TorchTrainer(make_model(dropout=0.2), make_data(), device="cpu")
    p0 = trainer.spec.flatten(trainer.model)
    a = trainer.train(p0, SETTINGS[name], seed=7)
    b = trainer.train(p0, SETTINGS[name], seed=7)
    c = trainer.train(p0, SETTINGS[name], seed=8)
    assert a.params.tobytes() == b.params.tobytes() != c.params.tobytes()
    assert a.metrics == b.metrics and a.metrics["train_loss"] != c.metrics["train_loss"]


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("variant", ["plain", "dropout", "weight decay", "micro-batches",
                                     "data function"])
def test_cpu_results_are_bit_identical_to_the_previous_trainer(name: str, variant: str) -> None:
    data = make_data()
    model = make_model(dropout=0.3 if variant == "dropout" else 0.0)
    source: Any = (lambda: data) if variant == "data function" else data
    kw: dict[str, Any] = {"weight_decay": 1e-3} if variant == "weight decay" else {}
    if variant == "micro-batches":
        kw["micro_batch"] = 5
    new = TorchTrainer(model, source, device="cpu", num_examples=len(data), **kw)
    old = TorchTrainer(make_model(dropout=0.3 if variant == "dropout" else 0.0), source,
                       device="cpu", num_examples=len(data), **kw)
    p0 = new.spec.flatten(new.model)
    got = new.train(p0, SETTINGS[name], seed=3)
    want_params, want_metrics = previous_train(old, p0, SETTINGS[name], seed=3)
    assert got.params.tobytes() == want_params.tobytes()
    assert got.metrics == want_metrics  # train_loss to the last bit, steps


def test_cpu_bf16_autocast_is_bit_identical_to_the_previous_trainer() -> None:
    data = make_data()
    new = TorchTrainer(make_model(), data, device="cpu", amp="bf16")
    old = TorchTrainer(make_model(), data, device="cpu", amp="bf16")
    p0 = new.spec.flatten(new.model)
    settings = SETTINGS["epochs, short last batch"]
    got = new.train(p0, settings, seed=1)
    want_params, want_metrics = previous_train(old, p0, settings, seed=1)
    assert got.params.tobytes() == want_params.tobytes() and got.metrics == want_metrics


# -- batches on the accelerator path ----------------------------------------------------------


def _collect(batches: Iterator[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.cpu().numpy().copy(), y.cpu().numpy().copy()) for x, y in batches]


@pytest.mark.parametrize("mode", ["device", "pinned"])
@pytest.mark.parametrize("batch", [1, 16, 70, 100])
def test_placed_batches_are_the_iter_batches_batches(monkeypatch, mode: str,
                                                     batch: int) -> None:
    """Every placement draws the permutation on the CPU from the same generator, so an
    accelerator sees exactly the batches iter_batches (and so a CPU run) gives. Run here on
    the CPU by forcing each placement (a CPU trainer gathers into unpinned memory, the same
    code); the CUDA tests below check the real devices."""
    monkeypatch.setattr(trainer_module, "data_placement", lambda *a, **k: mode)
    data = make_data(n=70)
    trainer = TorchTrainer(make_model(), data, device="cpu")
    for epoch_seed in (0, 5):
        got = _collect(trainer._array_batches(data, batch, torch.Generator().manual_seed(
            epoch_seed)))
        want = _collect(iter_batches(data, batch, torch.Generator().manual_seed(epoch_seed)))
        assert len(got) == len(want) == -(-70 // batch)
        for (gx, gy), (wx, wy) in zip(got, want, strict=True):
            assert gx.dtype == wx.dtype and gy.dtype == wy.dtype
            assert np.array_equal(gx, wx) and np.array_equal(gy, wy)
    assert trainer._placed is not None and trainer._placed.mode == mode
    assert (trainer._placed.x is not None) == (mode == "device")


def test_data_is_placed_once_and_again_when_replaced(monkeypatch) -> None:
    calls: list[int] = []

    def placement(nbytes: int, *args: Any, **kw: Any) -> str:
        calls.append(nbytes)
        return "device"

    monkeypatch.setattr(trainer_module, "data_placement", placement)
    data = make_data(n=40)
    trainer = TorchTrainer(make_model(), data, device="cpu")
    for _ in range(3):
        list(trainer._array_batches(data, 8, torch.Generator().manual_seed(0)))
    assert calls == [data.x.nbytes + data.y.nbytes]
    other = make_data(n=24, seed=1)
    list(trainer._array_batches(other, 8, torch.Generator().manual_seed(0)))
    assert calls[-1] == other.x.nbytes + other.y.nbytes and len(calls) == 2


# -- placement as a pure function --------------------------------------------------------------


MB = 1 << 20


@pytest.mark.parametrize(("nbytes", "device", "free", "want"), [
    (10 * MB, "cpu", 0, "host"),                # the CPU uses the arrays where they are
    (10**12, "cpu", 10 * MB, "host"),
    (10 * MB, "cuda", 80 * MB, "device"),       # 2 x 10 MB = exactly a quarter of 80 MB
    (10 * MB + 1, "cuda", 80 * MB, "pinned"),   # one byte over
    (0, "cuda", 0, "device"),
    (1, "cuda", 0, "pinned"),                   # free memory unknown / none: stream it
    (5 * MB, "mps", 100 * MB, "device"),
    (50 * MB, "mps", 100 * MB, "pageable"),     # no pinned memory off CUDA
])
def test_data_placement_choice(nbytes: int, device: str, free: int, want: str) -> None:
    assert data_placement(nbytes, device, free) == want


def test_data_placement_fraction_and_bad_input() -> None:
    assert RESIDENT_FRACTION == 0.25
    assert data_placement(10 * MB, "cuda", 40 * MB, fraction=0.5) == "device"
    assert data_placement(10 * MB, "cuda", 40 * MB, fraction=0.49) == "pinned"
    assert data_placement(0, "cuda", 40 * MB, fraction=0.0) == "device"
    assert data_placement(1, "cuda", 40 * MB, fraction=0.0) == "pinned"
    for bad in [(-1, "cuda", 1), (1, "cuda", -1)]:
        with pytest.raises(ValueError):
            data_placement(*bad)
    with pytest.raises(ValueError):
        data_placement(1, "cuda", 1, fraction=1.5)
    with pytest.raises(ValueError, match="resident_fraction"):
        TorchTrainer(make_model(), make_data(), device="cpu", resident_fraction=-0.1)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 70])
@pytest.mark.parametrize(("epochs", "steps"), [(1, 0), (3, 0), (0, 1), (0, 5), (0, 13)])
def test_full_batches_counts_the_whole_batches_a_task_takes(n: int, epochs: int,
                                                             steps: int) -> None:
    settings = TaskSettings(local_epochs=epochs, local_steps=steps, batch_size=16)
    trainer = TorchTrainer(make_model(), make_data(n=n), device="cpu")
    sizes: list[int] = []
    original = trainer._step

    def step(x, y, *args, **kw):
        sizes.append(len(y))
        return original(x, y, *args, **kw)

    trainer._step = step  # type: ignore[method-assign]
    trainer.train(trainer.spec.flatten(trainer.model), settings, seed=0)
    assert full_batches(n, settings) == sum(1 for s in sizes if s == 16)


# -- the losses are read once per task ---------------------------------------------------------


def test_losses_are_read_from_the_device_once_per_task(monkeypatch) -> None:
    """Count every Python-level read of a tensor's value (``item``, ``float``, ``tolist``)
    during a task: one ``tolist`` for all the losses, whatever the number of steps."""
    counts = {"item": 0, "__float__": 0, "tolist": 0}

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kw):
            counts[name] += 1
            return original(self, *args, **kw)
        return wrapper

    data = make_data(n=70)
    trainer = TorchTrainer(make_model(), data, device="cpu")
    p0 = trainer.spec.flatten(trainer.model)
    for name in counts:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    short = trainer.train(p0, TaskSettings(local_epochs=0, local_steps=3, batch_size=8), seed=1)
    assert counts == {"item": 0, "__float__": 0, "tolist": 1}
    long = trainer.train(p0, TaskSettings(local_epochs=3, batch_size=4), seed=1)
    assert counts == {"item": 0, "__float__": 0, "tolist": 2}
    assert short.metrics["steps"] == 3 and long.metrics["steps"] == 3 * 18


def test_the_loss_log_spans_chunks_in_step_order() -> None:
    log = trainer_module._LossLog(torch.device("cpu"))
    assert log.tensor().tolist() == []
    values = [float(v) for v in np.arange(2 * log.CHUNK + 7, dtype=np.float32) / 8]
    for v in values:
        log.add(torch.tensor(v))
    assert log.tensor().tolist() == values


# -- CUDA --------------------------------------------------------------------------------------


def _cuda_case(n: int = 520) -> tuple[ArrayDataset, TaskSettings]:
    # 520 examples at batch 16: 32 whole batches and a short one per epoch, so a graphed
    # task captures after its warm-up and runs the short batches eagerly
    return make_data(n=n), TaskSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9)


def _sync_warnings(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` under CUDA's sync debug mode; returns its result and how many host
    synchronisations it made."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("how", ["device", "pinned", "graph"])
def test_cuda_training_keeps_the_data_there_and_matches_the_cpu(how: str) -> None:
    data, settings = _cuda_case()
    cpu = TorchTrainer(make_model(), data, device="cpu")
    p0 = cpu.spec.flatten(cpu.model)
    want = cpu.train(p0, settings, seed=11)
    gpu = TorchTrainer(make_model(), data, device="cuda", amp="off",
                       resident_fraction=0.0 if how == "pinned" else RESIDENT_FRACTION,
                       cuda_graph=how == "graph")
    got = gpu.train(p0, settings, seed=11)
    assert gpu.placement == ("pinned" if how == "pinned" else "device")
    if how != "pinned":
        assert gpu._placed is not None and gpu._placed.x is not None
        assert gpu._placed.x.device.type == "cuda" and gpu._placed.y.device.type == "cuda"
    assert gpu._uses_graph(settings) == (how == "graph")
    assert got.metrics["steps"] == want.metrics["steps"] == 2 * 33
    # fp32 on both (no TF32): 66 steps of float rounding apart, far below what one batch out
    # of order would move (about 1e-2 here)
    np.testing.assert_allclose(got.params, want.params, rtol=1e-3, atol=1e-4)
    assert got.metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], rel=1e-4)
    again = gpu.train(p0, settings, seed=11)  # the same seed twice on the device
    np.testing.assert_allclose(again.params, got.params, rtol=1e-5, atol=1e-6)
    assert again.metrics["train_loss"] == pytest.approx(got.metrics["train_loss"], rel=1e-5)
    assert p0.tobytes() == cpu.spec.flatten(make_model()).tobytes()  # params never written


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_host_synchronisations_do_not_grow_with_the_steps(graph: bool) -> None:
    data, _ = _cuda_case()
    trainer = TorchTrainer(make_model(), data, device="cuda", amp="off", cuda_graph=graph)
    p0 = trainer.spec.flatten(trainer.model)
    trainer.train(p0, TaskSettings(local_epochs=1, batch_size=16), seed=0)  # placement
    counts = []
    for steps in (GRAPH_WARMUP + GRAPH_MIN_REPLAYS, 4 * (GRAPH_WARMUP + GRAPH_MIN_REPLAYS)):
        settings = TaskSettings(local_epochs=0, local_steps=steps, batch_size=16)
        result, syncs = _sync_warnings(lambda s=settings: trainer.train(p0, s, seed=1))
        assert result.metrics["steps"] == steps
        counts.append(syncs)
    assert counts[0] == counts[1] <= 6, counts


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_bf16_with_and_without_a_graph_agree() -> None:
    data, settings = _cuda_case()
    results = []
    for graph in (False, True):
        trainer = TorchTrainer(make_model(), data, device="cuda", amp="bf16", cuda_graph=graph)
        p0 = trainer.spec.flatten(trainer.model)
        results.append(trainer.train(p0, settings, seed=4))
    eager, graphed = results
    np.testing.assert_allclose(graphed.params, eager.params, rtol=1e-3, atol=1e-4)
    assert graphed.metrics["train_loss"] == pytest.approx(eager.metrics["train_loss"], rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_refuses_a_step_that_reads_the_host() -> None:
    class Syncing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x)
            return out * 2 if float(out.sum()) > 1e30 else out  # a host read per step

    data, settings = _cuda_case()
    trainer = TorchTrainer(Syncing(), data, device="cuda", amp="off", cuda_graph=True)
    with pytest.raises(RuntimeError, match="could not be captured"):
        trainer.train(trainer.spec.flatten(trainer.model), settings, seed=0)
    plain = TorchTrainer(Syncing(), data, device="cuda", amp="off")
    assert plain.train(plain.spec.flatten(plain.model), settings, seed=0).metrics["steps"] == 66


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("how", ["batch list", "micro-batches", "fp16"])
def test_cuda_other_data_buffers_and_precisions_match_the_cpu(how: str) -> None:
    """Batch norm (float buffers go in and out with the parameters), data given as batches
    (moved one by one), micro-batches and fp16 with its gradient scaler, against the CPU."""
    data, settings = _cuda_case(n=200)

    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))

    source: Any = data
    if how == "batch list":
        source = [(torch.from_numpy(data.x[i : i + 16]), torch.from_numpy(data.y[i : i + 16]))
                  for i in range(0, 200, 16)]
    kw: dict[str, Any] = {"num_examples": 200, "micro_batch": 8 if how == "micro-batches" else 0}
    cpu = TorchTrainer(model(), source, device="cpu", **kw)
    gpu = TorchTrainer(model(), source, device="cuda", amp="fp16" if how == "fp16" else "off",
                       **kw)
    p0 = cpu.spec.flatten(cpu.model)
    want, got = cpu.train(p0, settings, seed=2), gpu.train(p0, settings, seed=2)
    assert got.metrics["steps"] == want.metrics["steps"] == 2 * 13
    if how == "fp16":
        ref, upd = want.params - p0, got.params - p0
        assert float(ref @ upd / (np.linalg.norm(ref) * np.linalg.norm(upd))) >= 0.98
        assert got.metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], abs=0.05)
    else:
        np.testing.assert_allclose(got.params, want.params, rtol=1e-3, atol=1e-4)
        assert got.metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], rel=1e-4)
