"""Device profiling at start and mixed-precision training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from murmura.client import TorchTrainer
from murmura.edge import (
    amp_dtype,
    amp_supported,
    measure_training_speed,
    probe_micro_batch,
    profile_device,
)
from murmura.protocols import ModelSpec, TaskSettings
from murmura.server.limits import check_profile
from murmura.tasks import TaskConfig, load_task

CPU = torch.device("cpu")
_skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda(fn):  # noqa: ANN001, ANN201 - a marker pair
    return pytest.mark.gpu(_skip(fn))


def _digits():
    task = load_task(TaskConfig(task="digits", model="mlp", partition="iid"))
    return task, task.client_data(0, 4)


def test_profile_measures_a_positive_speed_and_fits_the_servers_limits() -> None:
    task, data = _digits()
    model = task.build_model(seed=0)
    before = ModelSpec.from_module(model).flatten(model).copy()

    prof = profile_device(model, torch.from_numpy(data.x[:16]), torch.from_numpy(data.y[:16]),
                          device=CPU, steps=3)

    assert prof.steps_per_s > 0 and float(prof.extra["examples_per_s"]) > 0
    assert prof.extra["profile_batch"] == "16" and prof.extra["amp"] == "off"
    assert int(prof.extra["memory_free"]) > 0
    check_profile(prof)  # the server takes it as it is: at most 16 short extras
    np.testing.assert_array_equal(ModelSpec.from_module(model).flatten(model), before)


def test_speed_counts_examples_per_step() -> None:
    ticks = iter([0.0, 2.0])
    model = torch.nn.Linear(4, 3)
    speed = measure_training_speed(model, torch.zeros(3, 4), torch.zeros(3, dtype=torch.long),
                                   device=CPU, batch_size=8, steps=4, warmup=0,
                                   clock=lambda: next(ticks))
    assert speed.steps_per_s == 2.0 and speed.examples_per_s == 16.0


def test_amp_is_off_on_the_cpu_unless_asked_and_modes_are_checked() -> None:
    assert amp_supported(CPU) == () and amp_dtype(CPU) is None
    assert amp_dtype(CPU, "bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="amp must be one of"):
        amp_dtype(CPU, "fp8")


def _train(device: str, amp: str) -> tuple[np.ndarray, float]:
    task, data = _digits()
    trainer = TorchTrainer(task.build_model(seed=1), data, device=device, amp=amp)
    start = trainer.spec.flatten(trainer.model).copy()
    result = trainer.train(start, TaskSettings(local_steps=20, batch_size=16, lr=0.1), seed=3)
    return result.params - start, result.metrics["train_loss"]


def test_bf16_training_stays_within_tolerance_of_fp32_on_the_cpu() -> None:
    # Tolerance: over 20 SGD steps the bf16 update's direction agrees with fp32's
    # (cosine >= 0.98), its norm within 10 %, and the mean training loss within 0.05.
    ref, loss_ref = _train("cpu", "off")
    amp, loss_amp = _train("cpu", "bf16")
    cos = float(ref @ amp / (np.linalg.norm(ref) * np.linalg.norm(amp)))
    assert cos >= 0.98
    assert abs(np.linalg.norm(amp) / np.linalg.norm(ref) - 1) <= 0.10
    assert abs(loss_amp - loss_ref) <= 0.05


@cuda
def test_default_amp_on_cuda_stays_within_tolerance_of_fp32() -> None:
    ref, loss_ref = _train("cuda", "off")
    amp, loss_amp = _train("cuda", "auto")
    cos = float(ref @ amp / (np.linalg.norm(ref) * np.linalg.norm(amp)))
    assert cos >= 0.98 and abs(loss_amp - loss_ref) <= 0.05


@cuda
def test_cuda_profile_reports_amp_support() -> None:
    task, data = _digits()
    prof = profile_device(task.build_model(seed=0), torch.from_numpy(data.x[:16]),
                          torch.from_numpy(data.y[:16]), device=torch.device("cuda"))
    assert prof.device == "cuda" and "fp16" in prof.extra["amp_supported"]
    assert prof.extra["amp"] in ("bf16", "fp16") and prof.steps_per_s > 0


def test_micro_batches_accumulate_to_the_whole_batch_gradient() -> None:
    task, data = _digits()
    start = None
    results = []
    for micro in (0, 5):
        trainer = TorchTrainer(task.build_model(seed=2), data, device="cpu", micro_batch=micro)
        start = trainer.spec.flatten(trainer.model).copy() if start is None else start
        r = trainer.train(start, TaskSettings(local_steps=10, batch_size=16, lr=0.1), seed=4)
        results.append(r)
    np.testing.assert_allclose(results[1].params, results[0].params, rtol=1e-5, atol=1e-6)
    assert abs(results[1].metrics["train_loss"] - results[0].metrics["train_loss"]) < 1e-5


def test_probe_halves_until_a_pass_fits_and_refuses_when_nothing_does() -> None:
    tried: list[int] = []

    def attempt(rows: int) -> None:
        tried.append(rows)
        if rows > 100:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    x, y = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    model = torch.nn.Linear(8, 2)
    assert probe_micro_batch(model, x, y, device=CPU, attempt=attempt) == 64
    assert tried == [1024, 512, 256, 128, 64]
    assert probe_micro_batch(model, x, y, device=CPU, largest=32) == 32  # a real pass

    def never(rows: int) -> None:
        raise torch.OutOfMemoryError("no")

    with pytest.raises(ValueError, match="zeroth-order"):
        probe_micro_batch(model, x, y, device=CPU, attempt=never)
