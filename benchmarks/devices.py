"""Training throughput of clients that share one device, as ``murmura launch`` runs them.

For 1, 2, 4 and 8 clients on one device, each client running Murmura's own
:class:`~murmura.client.TorchTrainer` (the trainer a ``murmura client`` uses: batches copied to
the device, SGD, mixed precision when asked), this measures the examples per second of all
clients together in two layouts:

* ``processes``: one process per client (what the launcher does: its own CUDA context, its own
  memory cap, a crash takes nothing else down);
* ``threads``: every client a thread of one process (one CUDA context shared).

and with mixed precision off and on (``auto``, bf16 or fp16 autocast, on a GPU; bf16 autocast
on a CPU). Two models: the digits task's MLP (64-64-10, batch 16: what the bundled tasks train,
launch-overhead bound on a GPU) and a wide MLP (64-2048-2048-10, batch 256: enough arithmetic for
mixed precision to matter). The device is the first CUDA GPU when there is one, else the CPU.

    python -m benchmarks.devices            # about 8 minutes
    python -m benchmarks.devices --quick    # about 3 minutes
    python -m benchmarks.devices --smoke    # 1 and 2 clients, amp off, one 2-step task each
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress  # noqa: E402

CLIENTS = (1, 2, 4, 8)
LAYOUTS = ("processes", "threads")
#: model name -> (hidden widths, batch size)
MODELS: dict[str, tuple[tuple[int, ...], int]] = {"task": ((64,), 16),
                                                   "wide": ((2048, 2048), 256)}
STEPS_PER_TASK = 20  # local steps per train() call, as a server's local_steps would say


def _device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _make_trainer(model: str, device: str, amp: str, seed: int,
                  steps: int = STEPS_PER_TASK) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    from murmura.client import TorchTrainer
    from murmura.protocols import TaskSettings
    from murmura.tasks.data import ArrayDataset

    hidden, batch = MODELS[model]
    widths = (64, *hidden)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    torch.manual_seed(seed)
    module = nn.Sequential(*layers, nn.Linear(widths[-1], 10))
    rng = np.random.default_rng(seed)
    data = ArrayDataset(rng.normal(size=(4096, 64)).astype(np.float32),
                        rng.integers(0, 10, 4096).astype(np.int64))
    trainer = TorchTrainer(module, data, device=device, amp=amp)
    settings = TaskSettings(local_steps=steps, batch_size=batch, lr=0.01,
                            momentum=0.0, seed=seed)
    return trainer, trainer.spec.flatten(trainer.model).copy(), settings


def _client(model: str, device: str, amp: str, seconds: float, seed: int,
            start: Any) -> tuple[int, float]:
    """One client: a warm-up task, then whole tasks until ``seconds`` have passed (a
    non-positive ``seconds`` means ``--smoke``: one task of 2 steps)."""
    steps = STEPS_PER_TASK if seconds > 0 else 2
    trainer, params, settings = _make_trainer(model, device, amp, seed, steps)
    trainer.train(params, settings, seed=seed)  # warm-up: kernels, allocator, autocast caches
    start.wait()
    examples, t0 = 0, time.perf_counter()
    while True:
        trainer.train(params, settings, seed=seed)
        examples += steps * settings.batch_size
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return examples, elapsed


def _threads_for(clients: int, device: str) -> int:
    return 1 if device.startswith("cuda") else max(1, (os.cpu_count() or 1) // clients)


def _process_main(model: str, device: str, amp: str, seconds: float, seed: int, clients: int,
                  start: Any, out: Any) -> None:
    import torch

    torch.set_num_threads(_threads_for(clients, device))
    out.put(_client(model, device, amp, seconds, seed, start))


def _threads_main(model: str, device: str, amp: str, seconds: float, clients: int,
                  out: Any) -> None:
    import torch

    torch.set_num_threads(_threads_for(clients, device))
    start = threading.Barrier(clients)
    results: list[tuple[int, float]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        r = _client(model, device, amp, seconds, i, start)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        out.put(r)


def measure(layout: str, clients: int, model: str, device: str, amp: str,
            seconds: float) -> float:
    """Examples per second of ``clients`` clients together (each in fresh processes)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if layout == "processes":
        start = ctx.Barrier(clients)
        procs = [ctx.Process(target=_process_main,
                             args=(model, device, amp, seconds, i, clients, start, out))
                 for i in range(clients)]
    else:
        procs = [ctx.Process(target=_threads_main,
                             args=(model, device, amp, seconds, clients, out))]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in range(clients)]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a {layout} worker exited with code {p.exitcode}")
    return sum(e for e, _ in results) / max(s for _, s in results)


def run(argv: list[str] | None = None) -> int:
    args = parse_args("devices", "Examples/s of 1-8 clients sharing one device", argv)
    device = _device()
    gpu = device.startswith("cuda")
    amps = ("off", "auto") if gpu else ("off", "bf16")
    if args.smoke:  # every cell spawns fresh processes (seconds each): the targets' cells only
        amps = amps[:1]
    seconds = 0.0 if args.smoke else 2.0 if args.quick else 6.0
    clients = (1, 2) if args.smoke else CLIENTS
    few, many = (4, 8) if 8 in clients else (max(clients), max(clients))
    import torch

    name = torch.cuda.get_device_name(0) if gpu else "CPU"
    report = Report("devices", quick=args.quick, params={
        "device": f"{device} ({name})", "clients": list(clients), "layouts": list(LAYOUTS),
        "amp": list(amps), "models": {k: f"hidden {v[0]}, batch {v[1]}"
                                      for k, v in MODELS.items()},
        "steps_per_task": STEPS_PER_TASK, "seconds_per_cell": seconds})
    rows: list[dict[str, Any]] = []
    for model in MODELS:
        for amp in amps:
            if not gpu and model == "wide":
                continue  # a CPU takes ~15 s per task of it (370 examples/s on 2 cores)
            for layout in LAYOUTS:
                for n in clients:
                    progress(f"{model} model, amp {amp}, {n} clients as {layout}")
                    eps = measure(layout, n, model, device, amp, seconds)
                    rows.append({"model": model, "amp": amp, "layout": layout, "clients": n,
                                 "examples_per_s": eps})
                    progress(f"  {eps:,.0f} examples/s")

    def eps(model: str, amp: str, layout: str, n: int) -> float:
        return next(r["examples_per_s"] for r in rows if (r["model"], r["amp"], r["layout"],
                                                         r["clients"]) == (model, amp, layout, n))

    for r in rows:
        r["vs_one"] = r["examples_per_s"] / eps(r["model"], r["amp"], r["layout"], 1)
    report.table(f"Examples/s of all clients together on {device} ({name})",
                 [Column("model", "model"), Column("amp", "amp"), Column("layout", "layout"),
                  Column("clients", "clients"),
                  Column("examples_per_s", "examples/s", "{:,.0f}"),
                  Column("vs_one", "vs 1 client", "{:.2f}x")], rows)

    best4 = max(eps("task", "off", lay, few) / eps("task", "off", lay, 1) for lay in LAYOUTS)
    report.target(f"{few} clients sharing the device vs 1 client, examples/s together (task "
                  "model, best layout)", best4, ">=", 1.0, unit="x")
    layout_ratio = min(eps(m, "off", "processes", many) / eps(m, "off", "threads", many)
                       for m in {r["model"] for r in rows})
    report.target(f"{many} clients as processes (the launcher's layout) vs as threads of one "
                  "process (worst model)", layout_ratio, ">=", 1.0, unit="x")
    if gpu:
        report.target("mixed precision (auto) vs fp32, wide model, 1 client",
                      eps("wide", "auto", "processes", 1) / eps("wide", "off", "processes", 1),
                      ">=", 1.2, unit="x")
    report.note(
        "Every cell starts fresh processes (spawn), warms each client up with one task, then "
        f"runs whole tasks of {STEPS_PER_TASK} local steps for {seconds:g} s behind a start "
        "barrier; examples/s is all clients' examples over the slowest client's time. On a "
        "CPU each process gets cores/clients intra-op threads (at least 1); on a GPU one. "
        "The mixed-precision target and the wide model are measured only on a GPU: CPU "
        "autocast is off by default, and a 2-core CPU takes about 15 s per task of the wide "
        "model.")
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(run())
