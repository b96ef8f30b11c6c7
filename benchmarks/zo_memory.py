"""Peak memory of zeroth-order training against first-order training and plain inference.

One model (64 -> H -> H -> 10 MLP; H = 3072 gives 9.67 M parameters, 38.7 MB of float32), one
batch of 64 random examples, and per case a fresh child process, so that no case inherits
another's allocator state:

* **inference** — ``loss_fn(model(x), y)`` under ``torch.no_grad``: the floor any client pays;
* **ZO** — ``ZOTrainer(return_params=False).train`` (what the client runtime uses: the update
  leaves as a seed payload), 3 steps;
* **ZO, returning params** — the same with a copy of the new model in the result;
* **first-order** — ``TorchTrainer.train``, 3 steps of SGD with momentum 0.5 (gradients and a
  momentum buffer), and with momentum 0.

Each child builds the model and the starting vector, runs the case once to warm up (lazy
allocations inside torch), drops the gradients a previous call left, then measures one more
call, three times: the peak RSS above the RSS before the call (Linux ``clear_refs``/``VmHWM``;
everything, numpy included; measured first, before other probes fragment the heap), the peak
of live torch CPU allocations (the profiler's memory events; exact, torch only) and the
tracemalloc peak (Python and numpy only). The resident model (its
float32 state, held by every case) is added to each peak: peak = model + peak growth.

Run: ``python benchmarks/zo_memory.py [--quick | --smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import (  # noqa: E402
    Column,
    Report,
    parse_args,
    peak_rss_delta,
    peak_traced_delta,
    progress,
    rss_probe_available,
)

NAME = "zo_memory"
BATCH = 64
STEPS = 3
CASES = {
    "inference": "inference (forward, no_grad)",
    "zo": "ZO trainer",
    "zo_params": "ZO trainer, returning params",
    "sgd": "first-order, momentum 0.5",
    "sgd_nomomentum": "first-order, momentum 0",
}


# -- the child: one case ---------------------------------------------------------------------


def _torch_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes of torch CPU allocations alive during ``fn()`` beyond those before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def run_case(case: str, hidden: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch import nn

    from murmura.client import TorchTrainer
    from murmura.client.zo import ZOTrainer
    from murmura.protocols import ModelSpec, TaskSettings
    from murmura.tasks import ArrayDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(BATCH, 64)).astype(np.float32),
                        rng.integers(0, 10, BATCH).astype(np.int64))
    spec = ModelSpec.from_module(model)
    start = spec.flatten(model)
    zo = case.startswith("zo")  # the seed codec carries zeroth-order steps only
    settings = TaskSettings(trainer="zo" if zo else "sgd", codec="seed" if zo else "dense-f32",
                            local_epochs=0, local_steps=STEPS, batch_size=BATCH, lr=1e-4,
                            momentum=0.0 if case == "sgd_nomomentum" else 0.5)
    fn: Callable[[], Any]
    if case == "inference":
        x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
        model.eval()

        def fn() -> float:
            with torch.no_grad():
                return float(nn.functional.cross_entropy(model(x), y))
    elif case.startswith("zo"):
        trainer = ZOTrainer(model, data, device="cpu", return_params=case == "zo_params")

        def fn() -> Any:
            return trainer.train(start, settings, seed=0)
    else:
        sgd = TorchTrainer(model, data, device="cpu")

        def fn() -> Any:
            return sgd.train(start, settings, seed=0)

    def probe(peak: Callable[[Callable[[], Any]], int | None]) -> int | None:
        model.zero_grad(set_to_none=True)  # an earlier call must not leave gradients behind
        gc.collect()
        return peak(fn)

    fn()  # warm up
    out: dict[str, Any] = {"case": case, "params": spec.size, "model_bytes": spec.nbytes}
    # RSS first, on an allocator no other probe has fragmented; the other two count
    # allocations, so the allocator settings the RSS probe leaves behind do not affect them.
    out["rss_peak"] = probe(peak_rss_delta)
    out["torch_peak"] = probe(_torch_peak)
    out["traced_peak"] = probe(peak_traced_delta)
    return out


# -- the parent: one child per case ----------------------------------------------------------


def measure(case: str, hidden: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--hidden",
           str(hidden)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    child = argparse.ArgumentParser(add_help=False)
    child.add_argument("--case", choices=sorted(CASES))
    child.add_argument("--hidden", type=int)
    known, rest = child.parse_known_args(argv)
    if known.case:
        print(json.dumps(run_case(known.case, known.hidden)), flush=True)
        return 0
    args = parse_args(NAME, __doc__.splitlines()[0], rest)
    hidden = 64 if args.smoke else 2048 if args.quick else 3072
    report = Report(NAME, quick=args.quick, params={"hidden": hidden, "batch": BATCH,
                                                     "steps": STEPS})
    results = {}
    for case in CASES:
        progress(f"measuring {case} (hidden {hidden})")
        results[case] = measure(case, hidden)
    model_bytes = results["inference"]["model_bytes"]
    params = results["inference"]["params"]
    rss_ok = rss_probe_available() and results["inference"]["rss_peak"] is not None

    def total(case: str, key: str) -> float:
        return float(model_bytes + (results[case][key] or 0))

    rows = []
    for case, label in CASES.items():
        r = results[case]
        row = {"case": label, "torch_growth": r["torch_peak"], "rss_growth": r["rss_peak"],
               "traced_growth": r["traced_peak"],
               "torch_total": total(case, "torch_peak"),
               "torch_ratio": total(case, "torch_peak") / total("inference", "torch_peak")}
        if rss_ok:
            row["rss_total"] = total(case, "rss_peak")
            row["rss_ratio"] = total(case, "rss_peak") / total("inference", "rss_peak")
        rows.append(row)
    mb = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    report.note(f"Model: 64 -> {hidden} -> {hidden} -> 10 MLP, {params:,} parameters, "
                f"{model_bytes / 2**20:.1f} MiB of float32 state, resident in every case; batch "
                f"{BATCH}, {STEPS} steps. Peak = model + the peak growth during the call.")
    report.table(
        f"Peak memory, {params / 1e6:.2f} M-parameter MLP",
        [Column("case", "case"),
         Column("torch_growth", "torch alloc growth", mb),
         Column("torch_total", "peak (torch alloc)", mb),
         Column("torch_ratio", "× inference (torch)", "{:.2f}"),
         Column("rss_growth", "RSS growth", mb),
         Column("rss_total", "peak (RSS)", mb),
         Column("rss_ratio", "× inference (RSS)", "{:.2f}"),
         Column("traced_growth", "numpy/Python growth", mb)], rows)
    by_case = {c: r for c, r in zip(CASES, rows, strict=True)}
    key = "rss_ratio" if rss_ok else "torch_ratio"
    report.target("ZO trainer peak vs inference peak", by_case["zo"][key], "<=", 1.2, unit="x",
                  detail="RSS" if rss_ok else "torch allocations")
    report.target("ZO trainer peak vs inference peak (torch allocations)",
                  by_case["zo"]["torch_ratio"], "<=", 1.2, unit="x")
    report.note(
        f"First-order training peaks at {by_case['sgd'][key]:.2f}x inference with momentum "
        f"({by_case['sgd_nomomentum'][key]:.2f}x without): gradients (1x model), the momentum "
        "buffer (1x) and the returned vector (1x, numpy) on top of the resident model, plus the "
        "activations kept for backward. The ZO trainer holds the model once (its tensors are "
        "views of one flat vector that is perturbed in place), a block of z (1 MiB plus the "
        "generator's int64 temporaries) and one forward pass's activations; returning the new "
        "model adds one copy.")
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(main())
