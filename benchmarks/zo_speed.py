"""Zeroth-order step speed: Murmura's ZO trainer against plain PyTorch MeZO and the memory floor.

One run, one device (``--device``: ``auto`` picks CUDA when there is one), and for every row the
same model, batch, ``eps`` and ``lr`` in every loop: a 64 -> H -> H -> 10 MLP (H = 960:
0.99 M parameters; H = 3072: 9.67 M; H = 9984: 100.4 M), cross-entropy on one fixed batch of
64 random examples; and the LM task's decoder (``tasks/lm.py``: ``gpt1m``, ``gpt10m``,
``gpt100m``; vocabulary 79, context 64) on one batch of 16 random token windows, the batch
``benchmarks/lm_finetune.py`` fine-tunes with.

**Step time** (table 1), per step, best of a few interleaved repetitions:

* ``murmura_ms`` — ``ZOTrainer(device=...).train`` with ``local_steps = S`` on an
  ``ArrayDataset`` of exactly 64 examples (so every step sees the same batch), divided by S.
  This is the whole task as a client runs it: the start vector copied in (from host memory, as
  the runtime hands it over), per step the batch taken from the data set and moved to the
  device, ``+eps z``, a loss, ``-2 eps z``, a loss, ``(eps + c) z``, and at the end the
  payload. The per-task parts are spread over S steps (S in the table).
  ``return_params=False``, as the client runtime uses it (so no exact rebuild of the model
  from the step log: the runtime never reads it). One warm-up call first (allocations; on
  CUDA the Triton kernel's compile).
* ``graph_ms`` (CUDA only) — the same with ``ZOTrainer(cuda_graph=True)``: each batch's
  forward pass and loss replayed as a captured CUDA graph.
* ``mezo_ms`` — a plain PyTorch MeZO loop written here as MeZO's reference trainer does it: per
  step a random seed; each parameter tensor perturbed in place by ``eps * z``, ``z`` regenerated
  from the seed (a ``torch.Generator`` on the device, ``torch.normal(0, 1, size=p.shape)`` per
  tensor) for every pass: ``+eps``, loss, ``-2 eps``, loss, ``+eps`` (restore), then the update
  ``p -= lr * g * z``. Both losses are read with one ``.item()``, as the reference does. It runs
  on the same module (its parameters are views of the trainer's flat vector: in-place updates
  of those views cost what they cost on separate tensors).
* ``floor_ms`` — the memory floor of a step: three read+write passes over theta
  (``3 * 8 * n`` bytes) at the copy bandwidth measured on this device at this size
  (``dst.copy_(src)`` on n float32 values, ``8 n / t``, best of several), plus the measured time
  of two forward passes on the batch. ``murmura/floor`` compares the trainer with it.

**Server replay** (table 2): ``replay_ms`` is ``seed.replay(theta_on_device, steps)`` for a
300-step log (``--quick`` on a CPU and ``--smoke``: fewer steps, the table says how many): a copy
of the reference plus every step applied, in one pass over theta per block. ``draw_ms`` is the
time to draw the same Rademacher vectors with the best exact generator on that device without
touching a model. On a CPU: for each stream, block by block, the words hashed into a reused
buffer (``prng.hash_words_into``) and expanded to +-1 (``index_select`` into a reused block),
as ``seed_steps._apply_steps_cpu`` does but without the add, on one torch thread as it runs.
On CUDA: one launch per stream of the fused kernel ``seed_triton.apply_steps_cuda`` with one
step on a scratch vector, which therefore includes that vector's read and write per stream.

Targets (computed from the measurements): on a CPU ``zo_step_vs_mezo_cpu_<size>`` <= 0.5 and
``zo_step_vs_floor_cpu_<size>`` <= 2.0 for every size run; on CUDA
``zo_step_vs_mezo_cuda_<size>`` <= 1.2 (the default, eager trainer),
``zo_step_ms_cuda_10M`` <= 1.0 ms (the trainer with ``cuda_graph=True``: at this size a step is
launch-bound, and two eager forward passes alone took 0.9-1.2 ms on some H100/H200 hosts) and
``zo_step_vs_floor_cuda_100M`` / ``..._gpt100m`` <= 3.0; ``replay_vs_draw_<device>`` <= 2.0 at
the 10M size (the largest size run when 10M is not, e.g. under ``--smoke``). A CUDA target whose
size was not run is reported with a NaN value, i.e. missed. For the decoder on a CPU, two
forward passes are over half of a MeZO step, so no perturbation code can halve the step: its
CPU target ``zo_overhead_vs_mezo_cpu_<size>`` <= 0.5 compares what each loop spends beyond
its two forwards (``step - two forwards``; the column ``beyond 2 forwards``), and the raw
ratio is in the table.

Sizes: 1M, 10M, 100M, gpt1m, gpt10m and gpt100m (``--quick`` on a CPU: 1M, 10M, gpt1m and
gpt10m; ``--smoke``: 10k and 100k; ``--sizes`` overrides, e.g. ``--sizes 1M,30M,gpt1m``).
Torch's default intra-op threads are used (the trainer's and the codec's CPU step kernels run
on one thread by design).

**First-order TorchTrainer** (table 3), examples/s on the same device: ``murmura`` is
``TorchTrainer(model, data, amp=...).train`` on an ``ArrayDataset`` of random examples, whole
tasks timed (``local_epochs`` epochs of whole batches; the parameters copied in and out, the
data's placement made at the warm-up call); ``hand`` is the plain PyTorch loop a user would
write with the data already on the device (per epoch a permutation drawn there and one
gather, ``opt.zero_grad``, forward, backward, ``torch.optim.SGD`` with the trainer's lr and
momentum, losses summed on the device and read once per call). Models: the digits task's
64-64-10 MLP at batch 16 (1,024 examples), a 64-2048-2048-10 MLP at batch 256 (``wide``:
4.35 M parameters; 4,096 examples on CUDA, 2,048 under ``--quick`` on a CPU, where a step takes
about 0.1 s) and, on CUDA only, the same MLP at batch 16384 (``wide16k``, 131,072
examples), where arithmetic dominates a step (at 4096 an H100's eager bf16 step still waits
for the host: plain PyTorch gained 1.17x over fp32 there). fp32 on every device; on CUDA
also bf16 autocast (both loops), and the trainer with ``cuda_graph=True`` as a third column.
On a CPU the digits model runs on one torch thread, as murmura's clients run it. Targets:
``fo_vs_hand_<device>_<model>`` >= 0.9 (fp32); on CUDA bf16 >= 1.3x fp32 where it should pay:
``fo_bf16_vs_fp32_cuda_wide16k`` (eager, the default trainer) and
``fo_bf16_vs_fp32_cuda_wide_graph`` (batch 256 with ``cuda_graph=True``). The eager batch-256
ratio is reported, not targeted: that step is launch-bound and autocast's cast kernels cost
more than its smaller matmuls save (docs/edge.md says so).

Imports. Only torch, numpy (and triton on CUDA) and this repository are needed: no gRPC, no
Flower. ``murmura.client``'s ``__init__`` loads the client runtime and its gRPC transport, so
``murmura.client`` is registered here as a bare package (its folder, its ``__init__`` not run)
before ``murmura.client.zo`` is imported; the trainer measured is the library's own. Where the
checkout is not pip-installed, setup.py's folder mapping is applied to the import system.

Run: ``python benchmarks/zo_speed.py [--quick | --smoke] [--device {auto,cpu,cuda}]``;
``--part fo`` (or ``zo``) with ``--no-save`` measures one part only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

# setup.py's layout: the package `murmura` is cli/, `murmura.<layer>` is <layer>/.
_LAYERS = ("aggregation", "client", "edge", "gossip", "protocols", "server", "simulation",
           "tasks")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """setup.py's ``package_dir`` mapping, for a checkout that is not pip-installed."""

    folders = {"murmura": "cli", **{f"murmura.{layer}": layer for layer in _LAYERS}}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, ROOT / folder / "__init__.py",
            submodule_search_locations=[str(ROOT / folder)])


def _import_trainer_without_runtime() -> None:
    """Make ``murmura.client.zo`` importable without ``murmura.client.__init__`` (gRPC)."""
    if importlib.util.find_spec("murmura") is None:
        sys.meta_path.append(_CheckoutFinder())
    if "murmura.client" in sys.modules:
        return
    found = importlib.util.find_spec("murmura.client")  # imports `murmura` (light), not this
    if found is None or not found.submodule_search_locations:
        raise ImportError("murmura.client not found")
    bare = importlib.util.module_from_spec(
        importlib.machinery.ModuleSpec("murmura.client", None, is_package=True))
    bare.__path__ = list(found.submodule_search_locations)
    sys.modules["murmura.client"] = bare
    sys.modules["murmura"].client = bare  # type: ignore[attr-defined]


_import_trainer_without_runtime()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._report import (  # noqa: E402
    Column,
    Report,
    interleaved,
    parse_args,
    progress,
    time_once,
)
from murmura.client.zo import ZOTrainer  # noqa: E402
from murmura.protocols import TaskSettings, prng  # noqa: E402
from murmura.protocols.codecs import seed as seed_codec  # noqa: E402
from murmura.protocols.codecs._util import one_torch_thread  # noqa: E402
from murmura.protocols.codecs.seed import APPLY_BLOCK, BlockDraw, ZOSteps  # noqa: E402

NAME = "zo_speed"
BATCH = 64
FEATURES, CLASSES = 64, 10
EPS, LR = 1e-3, 1e-4
#: hidden width per size label (64 -> H -> H -> 10); other labels are solved for H
HIDDEN = {"10k": 64, "100k": 280, "1M": 960, "10M": 3072, "100M": 9984}
#: the LM task's sizes (tasks/lm.py GPT_SIZES), a batch as benchmarks/lm_finetune.py takes it
GPT_LABELS = ("gpt1m", "gpt10m", "gpt100m")
LM_BATCH, LM_VOCAB = 16, 79
REPLAY_STEPS = 300
TARGET_MEZO = {"cpu": 0.5, "cuda": 1.2}
TARGET_FLOOR_CPU = 2.0
TARGET_MS_CUDA_10M = 1.0
TARGET_FLOOR_CUDA_100M = 3.0
TARGET_REPLAY = 2.0


# -- sizes -----------------------------------------------------------------------------------


def param_count(hidden: int) -> int:
    """Parameters of the 64 -> H -> H -> 10 MLP: weights and biases of its three layers."""
    return (FEATURES + 1) * hidden + (hidden + 1) * hidden + (hidden + 1) * CLASSES


def parse_size(label: str) -> int:
    """``"10M"`` -> 10_000_000; also ``k`` and ``G`` suffixes or a plain integer."""
    scale = {"k": 10**3, "M": 10**6, "G": 10**9}
    text = label.strip()
    try:
        if text and text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {label!r} (e.g. 1M, 250k)") from None


def hidden_for(label: str) -> int:
    """H for a size label: the table above, else the multiple of 32 closest to the size."""
    if label in HIDDEN:
        return HIDDEN[label]
    n = parse_size(label)
    root = (-(FEATURES + CLASSES + 2) + math.sqrt((FEATURES + CLASSES + 2) ** 2 + 4 * n)) / 2
    return max(32, 32 * round(root / 32))


def steps_per_call(n: int, device: str, quick: bool, smoke: bool) -> int:
    """Local steps per timed ``train`` call: enough that the per-task work is spread thin."""
    if smoke:
        return 3
    if device == "cuda":
        return 100 if quick else 200
    budget = 1e8 if quick else 2e8  # values touched per call, roughly constant time
    return max(3, min(20 if quick else 40, int(budget / n)))


# -- the cases -------------------------------------------------------------------------------


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, CLASSES))


def mezo_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
               gen: torch.Generator, rng: np.random.Generator) -> float:
    """``steps`` MeZO steps as the reference trainer takes them (see the module docstring)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def perturb(seed: int, scale: float) -> None:
        gen.manual_seed(seed)  # the reference: torch.manual_seed(zo_random_seed)
        for p in params:
            z = torch.normal(0.0, 1.0, size=p.shape, device=p.device, generator=gen)
            p.add_(z, alpha=scale * EPS)

    g = 0.0
    model.eval()
    with torch.no_grad():
        for _ in range(steps):
            seed = int(rng.integers(1_000_000_000))
            perturb(seed, 1.0)
            loss1 = nn.functional.cross_entropy(model(x), y)
            perturb(seed, -2.0)
            loss2 = nn.functional.cross_entropy(model(x), y)
            g = float(((loss1 - loss2) / (2 * EPS)).item())
            perturb(seed, 1.0)
            gen.manual_seed(seed)
            for p in params:  # zo_update: p -= lr * g * z
                z = torch.normal(0.0, 1.0, size=p.shape, device=p.device, generator=gen)
                p.add_(z, alpha=-LR * g)
    return g


def draw_cpu(n: int, keys: Sequence[tuple[int, int]], block: int = APPLY_BLOCK) -> torch.Tensor:
    """The CPU replay kernel's generator alone (``seed_steps.BlockDraw``, as ``_apply_steps_cpu``
    calls it, without the coefficient and the add): every stream's +-1 values, block by
    block. Returns the last block drawn."""
    draw = BlockDraw(min(block, n))
    out = torch.empty(0)
    with one_torch_thread(), torch.no_grad():
        for stream in keys:
            for start in range(0, n, block):
                out = draw.block(start, min(block, n - start))(stream, prng._TABLE_CPU)
    return out


def draw_cuda(scratch: torch.Tensor, keys: Sequence[tuple[int, int]],
              coeffs: Sequence[float]) -> None:
    """One launch of the fused kernel per stream, one step each, on a scratch vector."""
    from murmura.protocols.codecs import seed_triton

    for key, coeff in zip(keys, coeffs, strict=True):
        seed_triton.apply_steps_cuda(scratch, [key], [coeff])


def _synced(fn: Callable[[], Any], sync: Callable[[], None]) -> Callable[[], Any]:
    def run() -> Any:
        out = fn()
        sync()
        return out
    return run


def best_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None],
              inner: int = 1) -> float:
    """Best of ``repeats`` timings of ``inner`` calls of ``fn`` (synchronised), per call."""
    run = _synced(lambda: [fn() for _ in range(inner)], sync)
    sync()
    return min(time_once(run)[0] for _ in range(repeats)) / inner


def copy_time(theta: torch.Tensor, repeats: int, sync: Callable[[], None], inner: int) -> float:
    """Seconds of one ``dst.copy_(src)`` of theta's size on its device (read n, write n)."""
    src = theta.detach().clone()
    dst = torch.empty_like(src)
    return best_time(lambda: dst.copy_(src), repeats, sync, inner=inner)


# -- first-order TorchTrainer ------------------------------------------------------------------

#: model -> (layer widths, batch): the digits task's MLP and a wide one whose step is arithmetic
FO_MODELS = {"digits": ((64, 64, 10), 16), "wide": ((64, 2048, 2048, 10), 256),
             "wide16k": ((64, 2048, 2048, 10), 16384)}
#: models measured on CUDA only: the wide model at a batch where arithmetic dominates the
#: step on an H100 (at 4096 the eager bf16 step still waits on the host: the hand loop
#: gained 1.17x there); on a 2-core CPU one of its steps takes about 6 s
FO_CUDA_ONLY = ("wide16k",)
FO_LR, FO_MOMENTUM = 0.01, 0.9
TARGET_FO_VS_HAND = 0.9
TARGET_FO_BF16 = 1.3


def fo_model(widths: Sequence[int]) -> nn.Module:
    """Linear layers of these widths with ReLU between them (seeded)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def fo_sizes(model: str, device: str, quick: bool, smoke: bool) -> tuple[tuple[int, ...], int,
                                                                        int, int]:
    """(widths, batch, examples, epochs per task) for one first-order case: whole batches
    only, and enough steps per task that its per-task work (parameters in and out) is spread
    thin; on a CPU the wide model is kept to a few steps (a 2-core CPU takes about 0.1 s per
    step)."""
    widths, batch = FO_MODELS[model]
    if smoke:
        return ((64, 128, 128, 10) if model == "wide" else widths), batch, 4 * batch, 1
    if device == "cuda":
        if model == "wide16k":
            return widths, batch, 8 * batch, 4
        return widths, batch, 64 * batch if model == "digits" else 16 * batch, \
            4 if model == "digits" else 8
    if model == "digits":
        return widths, batch, 64 * batch, 2 if quick else 4
    return widths, batch, (8 if quick else 16) * batch, 1


def hand_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: TaskSettings,
              amp: torch.dtype | None, gen: torch.Generator) -> float:
    """The plain PyTorch loop a user would write with the data already on the device: per
    epoch a permutation drawn there and one gather, batches sliced from it, SGD with momentum
    as TorchTrainer configures it from ``settings``, losses summed on the device and read
    once."""
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    total = torch.zeros((), device=x.device)
    n, b = len(x), settings.batch_size
    model.train()
    for _ in range(settings.local_epochs):
        perm = torch.randperm(n, device=x.device, generator=gen)
        xs, ys = x[perm], y[perm]
        for s in range(0, n, b):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(x.device.type, dtype=amp or torch.float32,
                                enabled=amp is not None):
                loss = nn.functional.cross_entropy(model(xs[s : s + b]), ys[s : s + b])
            loss.backward()
            opt.step()
            total += loss.detach()
    return float(total)


def measure_first_order(model_name: str, device: torch.device, *, quick: bool, smoke: bool,
                        repeats: int) -> list[dict[str, Any]]:
    """Examples/s of ``TorchTrainer.train`` against :func:`hand_loop` for one model, in fp32
    (and on CUDA in bf16), with and (on CUDA) without a CUDA graph. One row per precision."""
    from murmura.client.torch_trainer import TorchTrainer
    from murmura.tasks import ArrayDataset

    cuda = device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    widths, batch, n, epochs = fo_sizes(model_name, device.type, quick, smoke)
    settings = TaskSettings(local_epochs=epochs, batch_size=batch, lr=FO_LR,
                            momentum=FO_MOMENTUM)
    steps = epochs * (n // batch)
    rng = np.random.default_rng(3)
    data = ArrayDataset(rng.normal(size=(n, widths[0])).astype(np.float32),
                        rng.integers(0, widths[-1], n).astype(np.int64))
    x = torch.from_numpy(data.x).to(device)
    y = torch.from_numpy(data.y).to(device)
    params = sum(p.numel() for p in fo_model(widths).parameters())
    progress(f"first-order {model_name}: {'-'.join(map(str, widths))} MLP, {params:,} "
             f"parameters, batch {batch}, {n} examples x {epochs} epochs = {steps} steps per "
             f"task on {device}")
    def one_precision(amp_name: str, amp: torch.dtype | None) -> dict[str, Any]:
        amp_mode = "off" if amp is None else "bf16"
        trainers = {"murmura": TorchTrainer(fo_model(widths), data, device=str(device),
                                            amp=amp_mode)}
        if cuda:
            trainers["graph"] = TorchTrainer(fo_model(widths), data, device=str(device),
                                             amp=amp_mode, cuda_graph=True)
        start = trainers["murmura"].spec.flatten(trainers["murmura"].model)
        hand_model = fo_model(widths).to(device)
        gen = torch.Generator(device=device).manual_seed(0)
        task_seed = iter(range(10**6))
        cases: dict[str, Callable[[], Any]] = {
            name: _synced(lambda t=t: t.train(start, settings, seed=next(task_seed)), sync)
            for name, t in trainers.items()}
        cases["hand"] = _synced(lambda: hand_loop(hand_model, x, y, settings, amp, gen), sync)
        for fn in cases.values():  # warm-up: allocations, cuBLAS, the data's placement
            fn()

        def check(name: str, out: Any) -> None:
            if name == "hand":
                assert math.isfinite(out), out
            else:
                assert out.metrics["steps"] == steps and math.isfinite(
                    out.metrics["train_loss"]), out.metrics

        times = interleaved(cases, repeats=repeats, check=check,
                            label=f"first-order {model_name} {amp_name}")
        rate = {name: steps * batch / min(t) for name, t in times.items()}
        placement = trainers["murmura"].placement
        assert placement in ("host", "device"), placement
        progress(f"first-order {model_name} {amp_name}: murmura {rate['murmura']:,.0f}, hand "
                 f"{rate['hand']:,.0f}"
                 + (f", graph {rate['graph']:,.0f}" if "graph" in rate else "") + " examples/s")
        return {"model": model_name, "widths": "-".join(map(str, widths)), "params": params,
                "batch": batch, "amp": amp_name, "steps": steps, "placement": placement,
                "murmura": rate["murmura"], "hand": rate["hand"], "graph": rate.get("graph"),
                "murmura_vs_hand": rate["murmura"] / rate["hand"],
                "graph_vs_hand": rate["graph"] / rate["hand"] if "graph" in rate else None}

    precisions: list[tuple[str, torch.dtype | None]] = [("fp32", None)]
    if cuda:
        precisions.append(("bf16", torch.bfloat16))
    # the small model on a CPU: one torch thread, as murmura's clients and the simulation run
    # it (two threads' OpenMP barriers cost more than its kernels, badly so on a busy machine)
    threads = one_torch_thread() if not cuda and model_name == "digits" \
        else contextlib.nullcontext()
    with threads:
        return [one_precision(name, amp) for name, amp in precisions]


# -- one size --------------------------------------------------------------------------------


def is_lm(label: str) -> bool:
    return label in GPT_LABELS


def build_case(label: str) -> tuple[nn.Module, Any, int, str]:
    """(model, data of exactly one batch, batch size, description) for a size label: an MLP
    size (``1M``) or an LM task size (``gpt10m``: the task's decoder on random token windows
    of its context; the step time does not depend on which tokens)."""
    from murmura.tasks import ArrayDataset

    rng = np.random.default_rng(0)
    if is_lm(label):
        from murmura.tasks.lm import CONTEXT, gpt

        model = gpt(label, LM_VOCAB)
        tokens = rng.integers(0, LM_VOCAB, size=(LM_BATCH, CONTEXT + 1))
        data = ArrayDataset(tokens[:, :-1].astype(np.float32), tokens[:, 1:].astype(np.int64))
        cfg = model.config
        return model, data, LM_BATCH, (f"LM task decoder ({cfg.n_layers} layers, d_model "
                                       f"{cfg.d_model}), batch {LM_BATCH} x {CONTEXT} tokens")
    hidden = hidden_for(label)
    data = ArrayDataset(rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
                        rng.integers(0, CLASSES, BATCH).astype(np.int64))
    return make_model(hidden), data, BATCH, f"64 -> {hidden} -> {hidden} -> 10 MLP"


def measure_size(label: str, device: torch.device, *, quick: bool, smoke: bool, repeats: int,
                 replay_steps: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One size's step row and (for MLP sizes; the replay depends on the size only) its
    replay row."""
    model0, data, batch, what = build_case(label)
    n = sum(p.numel() for p in model0.parameters())
    cuda = device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    steps = steps_per_call(n, device.type, quick, smoke)
    if is_lm(label) and not cuda:
        steps = max(3, steps // 2)  # forward-dominated: a CPU call is already long
    progress(f"{label}: {what}, {n:,} parameters on {device}; {steps} steps per call")

    trainer = ZOTrainer(model0, data, device=str(device), return_params=False)
    model, theta = trainer.model, trainer.theta
    assert theta.numel() == n, (theta.numel(), n)
    start = theta.detach().to("cpu", copy=True).numpy()
    x = torch.from_numpy(data.x).to(device)
    y = torch.from_numpy(data.y).to(device)
    settings = TaskSettings(trainer="zo", codec="seed", local_epochs=0, local_steps=steps,
                            batch_size=batch, lr=LR, zo_eps=EPS)
    gen = torch.Generator(device=device)
    mezo_rng = np.random.default_rng(1)
    task_seed = iter(range(10**6))

    trainers = {"murmura": trainer}
    if cuda:  # the same trainer with its forward passes replayed as a CUDA graph
        trainers["graph"] = ZOTrainer(build_case(label)[0], data, device=str(device),
                                      return_params=False, cuda_graph=True)
    cases: dict[str, Callable[[], Any]] = {
        name: _synced(lambda t=t: t.train(start, settings, seed=next(task_seed)), sync)
        for name, t in trainers.items()}
    cases["mezo"] = _synced(lambda: mezo_steps(model, x, y, steps, gen, mezo_rng), sync)

    # warm-up: allocations, cuBLAS handles, the Triton kernel's compile, the graphs' capture
    warm = TaskSettings(trainer="zo", codec="seed", local_epochs=0, local_steps=2,
                        batch_size=batch, lr=LR, zo_eps=EPS)
    for t in trainers.values():
        t.train(start, warm, seed=10**7)
    mezo_steps(model, x, y, 1, gen, mezo_rng)
    sync()

    def check(name: str, out: Any) -> None:
        if name == "mezo":
            assert math.isfinite(out), out
        else:
            assert out.metrics["steps"] == steps, out.metrics

    times = interleaved(cases, repeats=repeats, check=check, label=f"{label} step")
    murmura_ms = min(times["murmura"]) / steps * 1e3
    mezo_ms = min(times["mezo"]) / steps * 1e3
    graph_ms = min(times["graph"]) / steps * 1e3 if "graph" in times else None

    # the floor: three read+write passes at the measured copy bandwidth, plus two forwards
    copy_s = copy_time(theta, max(repeats, 3) + 2, sync, inner=20 if cuda else 3)
    model.eval()

    def two_forwards() -> float:
        with torch.no_grad():
            a = float(nn.functional.cross_entropy(model(x), y))
            b = float(nn.functional.cross_entropy(model(x), y))
        return a + b

    fwd2_s = best_time(two_forwards, max(repeats, 3) + 2, sync)
    bandwidth = 8 * n / copy_s
    floor_ms = (3 * 8 * n / bandwidth + fwd2_s) * 1e3
    progress(f"{label}: murmura {murmura_ms:.2f} ms/step, mezo {mezo_ms:.2f} ms/step, floor "
             f"{floor_ms:.2f} ms (copy {bandwidth / 1e9:.1f} GB/s, two forwards "
             f"{fwd2_s * 1e3:.2f} ms)")
    step_row = {"size": label, "model": what, "params": n, "steps": steps,
                "murmura_ms": murmura_ms, "mezo_ms": mezo_ms, "floor_ms": floor_ms,
                "graph_ms": graph_ms,
                "copy_gbs": bandwidth / 1e9, "fwd2_ms": fwd2_s * 1e3,
                "murmura_vs_mezo": murmura_ms / mezo_ms, "murmura_vs_floor": murmura_ms / floor_ms,
                # what each loop adds to its two forward passes: the perturbations and the step
                "overhead_vs_mezo": (murmura_ms - fwd2_s * 1e3) / (mezo_ms - fwd2_s * 1e3)}
    if is_lm(label):
        return step_row, None

    # server replay of a step log, against the generator alone
    log_rng = np.random.default_rng(2)
    log = ZOSteps(lr=LR, seeds=log_rng.integers(1, 2**32, replay_steps, dtype=np.uint64),
                  grads=log_rng.normal(size=replay_steps).astype(np.float32))
    keys = [prng.stream_keys(int(s)) for s in log.seeds]
    coeffs = [float(c) for c in log.coefficients]
    draw: Callable[[], Any] | None
    if cuda:
        from murmura.protocols.codecs import seed_triton

        scratch = torch.zeros(n, dtype=torch.float32, device=device)
        draw = (lambda: draw_cuda(scratch, keys, coeffs)) if seed_triton.available(device) \
            else None
    else:
        draw = lambda: draw_cpu(n, keys)  # noqa: E731
        first = draw_cpu(min(n, APPLY_BLOCK), keys[:1])[: min(n, APPLY_BLOCK)]
        assert torch.equal(first, prng.rademacher(int(log.seeds[0]), first.numel())), \
            "draw_cpu is not the seed codec's stream"

    def replay() -> torch.Tensor:
        return seed_codec.replay(theta, log)

    cases: dict[str, Callable[[], Any]] = {"replay": _synced(replay, sync)}
    if draw is not None:
        cases["draw"] = _synced(draw, sync)
    short = ZOSteps(lr=LR, seeds=log.seeds[:2], grads=log.grads[:2])
    seed_codec.replay(theta, short)  # warm-up
    if draw is not None and cuda:
        draw_cuda(scratch, keys[:2], coeffs[:2])
    elif draw is not None:
        draw_cpu(n, keys[:2])
    sync()
    times = interleaved(cases, repeats=repeats, label=f"{label} replay of {replay_steps} steps")
    replay_ms = min(times["replay"]) * 1e3
    draw_ms = min(times["draw"]) * 1e3 if draw is not None else math.nan
    replay_row = {"size": label, "params": n, "steps": replay_steps, "replay_ms": replay_ms,
                  "draw_ms": draw_ms, "replay_vs_draw": replay_ms / draw_ms,
                  "replay_ns_per_value_step": replay_ms * 1e6 / (n * replay_steps)}
    return step_row, replay_row


# -- the report ------------------------------------------------------------------------------


def _extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model and theta live (auto: CUDA when available)")
    parser.add_argument("--sizes", default=None, metavar="LIST",
                        help="comma-separated model sizes, e.g. 1M,10M,100M (default: 1M, 10M, "
                             "100M; --quick on a CPU 1M, 10M; --smoke 10k, 100k)")
    parser.add_argument("--part", choices=("all", "zo", "fo"), default="all",
                        help="measure only the zeroth-order tables (zo) or only the first-order "
                             "TorchTrainer table (fo); a partial run needs --no-save or "
                             "--smoke, so it never replaces the saved report")


def _versions() -> dict[str, Any]:
    try:
        import triton
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        triton_version = None
    else:
        triton_version = getattr(triton, "__version__", "unknown")
    return {"torch": torch.__version__, "triton": triton_version}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, __doc__.splitlines()[0], argv, extra=_extra_args)
    if args.part != "all" and not (args.no_save or args.smoke):
        raise SystemExit("--part zo/fo measures part of the report: add --no-save")
    run_zo, run_fo = args.part in ("all", "zo"), args.part in ("all", "fo")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    kind = "cuda" if args.device == "cuda" or (args.device == "auto"
                                              and torch.cuda.is_available()) else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" \
        else torch.device("cpu")
    if args.sizes:
        sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
        for s in sizes:
            if not is_lm(s):
                parse_size(s)
    elif args.smoke:
        sizes = ["10k", "100k"]
    elif args.quick and kind == "cpu":
        sizes = ["1M", "10M", "gpt1m", "gpt10m"]
    else:
        sizes = ["1M", "10M", "100M", *GPT_LABELS]
    repeats = 1 if args.smoke else 2 if args.quick else 3
    replay_steps = 5 if args.smoke else 60 if (args.quick and kind == "cpu") else REPLAY_STEPS
    device_name = torch.cuda.get_device_name(device) if kind == "cuda" else None

    # One result per device kind (results/zo_speed.json, results/zo_speed_cuda.json): a CPU run
    # and a GPU run, usually on different machines, do not replace each other.
    report = Report(NAME if kind == "cpu" else f"{NAME}_cuda", quick=args.quick)
    report.params.update({
        "device": str(device), "device_name": device_name or report.machine["cpu_model"],
        **_versions(), "torch_threads": torch.get_num_threads(), "sizes": sizes,
        "batch": BATCH, "eps": EPS, "lr": LR, "repeats": repeats, "replay_steps": replay_steps,
        "part": args.part, "fo_lr": FO_LR, "fo_momentum": FO_MOMENTUM,
    })
    if kind == "cpu":
        report.params["gpu_rows"] = "not run (no CUDA device here)"
    progress(f"device {device} ({report.params['device_name']}), sizes {', '.join(sizes)}, "
             f"best of {repeats}")

    step_rows: list[dict[str, Any]] = []
    replay_rows: list[dict[str, Any]] = []
    for label in sizes if run_zo else []:
        t0 = time.perf_counter()
        step_row, replay_row = measure_size(label, device, quick=args.quick, smoke=args.smoke,
                                            repeats=repeats, replay_steps=replay_steps)
        step_rows.append(step_row)
        if replay_row is not None:
            replay_rows.append(replay_row)
        if kind == "cuda":
            torch.cuda.empty_cache()
        progress(f"{label} done in {time.perf_counter() - t0:.1f} s")
    fo_rows: list[dict[str, Any]] = []
    for model_name in FO_MODELS if run_fo else []:
        if model_name in FO_CUDA_ONLY and kind != "cuda":
            continue
        t0 = time.perf_counter()
        fo_rows += measure_first_order(model_name, device, quick=args.quick, smoke=args.smoke,
                                       repeats=repeats)
        if kind == "cuda":
            torch.cuda.empty_cache()
        progress(f"first-order {model_name} done in {time.perf_counter() - t0:.1f} s")

    where = f"{device_name} (CUDA)" if device_name else \
        f"CPU, {report.machine['cpus_usable']} cores"
    report.note(
        f"Device: {where}; torch {report.params['torch']}, triton {report.params['triton']}. "
        f"64 -> H -> H -> 10 MLP, cross-entropy on one fixed batch of {BATCH} random examples "
        f"(`gpt*` rows: the LM task's decoder on {LM_BATCH} random token windows), "
        f"eps {EPS:g}, lr {LR:g}; best of {repeats} interleaved repetitions. `murmura` is "
        "`ZOTrainer.train(return_params=False)` with `local_steps` = S divided by S (the "
        "task's copy-in and payload included); `mezo` is the reference MeZO loop in plain "
        "PyTorch (Gaussian z regenerated per tensor for each of its four passes); `floor` is "
        "three read+write passes over theta at the measured copy bandwidth plus two forward "
        "passes.")
    if kind == "cpu":
        report.note("GPU rows not run: no CUDA device here (`python benchmarks/zo_speed.py "
                    "--device cuda` on a GPU machine measures them).")
    if args.quick or args.smoke:
        report.note(f"{'Smoke' if args.smoke else 'Quick'} run: sizes {', '.join(sizes)}; the "
                    f"replay log has {replay_steps} steps instead of {REPLAY_STEPS}.")

    if run_zo:
        _zo_tables(report, kind, step_rows, replay_rows, replay_steps)
    if run_fo:
        _fo_table(report, kind, fo_rows)
    return report.finish(save=not args.no_save)


def _zo_tables(report: Report, kind: str, step_rows: list[dict[str, Any]],
               replay_rows: list[dict[str, Any]], replay_steps: int) -> None:
    ms = "{:,.2f}".format
    ratio = "{:.2f}".format
    report.table(f"Zeroth-order step time on {kind}", [
        Column("size", "size"), Column("model", "model"), Column("params", "parameters", "{:,}"),
        Column("steps", "S"), Column("murmura_ms", "murmura ms/step", ms),
        Column("mezo_ms", "mezo ms/step", ms), Column("floor_ms", "floor ms", ms),
        Column("copy_gbs", "copy GB/s", "{:.1f}"), Column("fwd2_ms", "2 forwards ms", ms),
        Column("murmura_vs_mezo", "murmura/mezo", ratio),
        Column("murmura_vs_floor", "murmura/floor", ratio),
        Column("overhead_vs_mezo", "beyond 2 forwards: murmura/mezo", ratio),
        Column("graph_ms", "murmura, CUDA graph ms/step", ms)], step_rows)
    report.table(f"Server replay of a {replay_steps}-step update on {kind}", [
        Column("size", "size"), Column("params", "parameters", "{:,}"),
        Column("steps", "steps"), Column("replay_ms", "replay ms", ms),
        Column("draw_ms", "draw ms", ms), Column("replay_vs_draw", "replay/draw", ratio),
        Column("replay_ns_per_value_step", "replay ns/value/step", "{:.3f}")], replay_rows)

    by_size = {r["size"]: r for r in step_rows}
    for r in step_rows:
        if kind == "cpu" and is_lm(r["size"]):
            # A CPU forward of the decoder is most of a MeZO step, so no perturbation code can
            # halve the step: the target compares what the two loops add to the forwards.
            report.target(f"zo_overhead_vs_mezo_cpu_{r['size']}", r["overhead_vs_mezo"], "<=",
                          TARGET_MEZO[kind], unit="x", detail="step minus two forwards")
        else:
            report.target(f"zo_step_vs_mezo_{kind}_{r['size']}", r["murmura_vs_mezo"], "<=",
                          TARGET_MEZO[kind], unit="x")
        if kind == "cpu":
            report.target(f"zo_step_vs_floor_cpu_{r['size']}", r["murmura_vs_floor"], "<=",
                          TARGET_FLOOR_CPU, unit="x")
    if kind == "cuda":
        r10 = by_size.get("10M")
        report.target("zo_step_ms_cuda_10M", r10["graph_ms"] if r10 else math.nan, "<=",
                      TARGET_MS_CUDA_10M, unit="ms",
                      detail="cuda_graph=True" if r10 else "10M not run: NaN")
        for big in ("100M", "gpt100m"):
            r100 = by_size.get(big)
            report.target(f"zo_step_vs_floor_cuda_{big}", r100["murmura_vs_floor"] if r100
                          else math.nan, "<=", TARGET_FLOOR_CUDA_100M, unit="x",
                          detail="" if r100 else f"{big} not run: NaN")
    replay_by_size = {r["size"]: r for r in replay_rows}
    if replay_rows:
        at = "10M" if "10M" in replay_by_size else \
            max(replay_rows, key=lambda r: r["params"])["size"]
        report.target(f"replay_vs_draw_{kind}", replay_by_size[at]["replay_vs_draw"], "<=",
                      TARGET_REPLAY, unit="x", detail=f"at {at}, {replay_steps} steps")
    else:
        report.target(f"replay_vs_draw_{kind}", math.nan, "<=", TARGET_REPLAY, unit="x",
                      detail="no MLP size run: NaN")
    if kind == "cuda":
        report.note("On CUDA `draw` launches the fused kernel once per stream on a scratch "
                    "vector, so it also reads and writes that vector once per stream; the "
                    "replay reads and writes theta once for the whole log.", after_tables=True)


def _fo_table(report: Report, kind: str, rows: list[dict[str, Any]]) -> None:
    rate = "{:,.0f}".format
    ratio = "{:.2f}".format
    report.table(f"First-order TorchTrainer on {kind}: examples/s", [
        Column("model", "model"), Column("widths", "MLP"), Column("params", "parameters", "{:,}"),
        Column("batch", "batch"), Column("amp", "precision"), Column("steps", "steps/task"),
        Column("placement", "data"), Column("murmura", "murmura", rate),
        Column("hand", "hand loop", rate), Column("murmura_vs_hand", "murmura/hand", ratio),
        Column("graph", "murmura, CUDA graph", rate),
        Column("graph_vs_hand", "graph/hand", ratio)], rows)
    by = {(r["model"], r["amp"]): r for r in rows}
    for model_name in FO_MODELS:
        r = by.get((model_name, "fp32"))
        if r is not None:
            report.target(f"fo_vs_hand_{kind}_{model_name}", r["murmura_vs_hand"], ">=",
                          TARGET_FO_VS_HAND, unit="x", detail="fp32, examples/s")
    if kind == "cuda":
        def bf16_gain(model_name: str, column: str) -> float:
            fp32, bf16 = by.get((model_name, "fp32")), by.get((model_name, "bf16"))
            if fp32 is None or bf16 is None:
                return math.nan
            return float(bf16[column] / fp32[column])

        # Where arithmetic dominates the step (batch 16384) autocast pays as it is; at batch
        # 256 the eager step is launch-bound (autocast adds cast kernels), so there the gain
        # needs CUDA graphs, and the eager ratio is reported in the table, not targeted.
        report.target("fo_bf16_vs_fp32_cuda_wide16k", bf16_gain("wide16k", "murmura"), ">=",
                      TARGET_FO_BF16, unit="x", detail="eager, batch 16384")
        report.target("fo_bf16_vs_fp32_cuda_wide_graph", bf16_gain("wide", "graph"), ">=",
                      TARGET_FO_BF16, unit="x", detail="cuda_graph=True, batch 256")
        report.note(f"bf16/fp32 of the eager trainer on the wide model at batch 256: "
                    f"{bf16_gain('wide', 'murmura'):.2f}x (launch-bound: autocast's casts "
                    "cost more than the smaller matmuls save; see docs/edge.md).",
                    after_tables=True)
    report.note(
        "First-order table: `murmura` is `TorchTrainer(model, data, amp=...).train` on an "
        "`ArrayDataset` of random examples (whole batches only; `data` says where the trainer "
        "put it), whole tasks of `local_epochs` epochs timed, parameters copied in and out "
        "included; `hand loop` is plain PyTorch with the data already on the device (a "
        "permutation and one gather per epoch, `opt.zero_grad`, forward, backward, "
        "`torch.optim.SGD` with the same lr and momentum, losses summed on the device and "
        f"read once); lr {FO_LR:g}, momentum {FO_MOMENTUM:g}. On CUDA `murmura, CUDA graph` "
        "is the same trainer with `cuda_graph=True`, and bf16 rows use autocast in both.",
        after_tables=True)


if __name__ == "__main__":
    raise SystemExit(main())
