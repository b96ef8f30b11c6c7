"""Flower's quickstart apps on Murmura against Flower's own simulation: same app, same run.

Issue 32's target: Flower's current quickstart ClientApps run unchanged on Murmura and reach
the accuracy they reach under ``flwr run`` on the same data, within 2 points.

The apps are ``tests/flower/apps/`` (``flwr new`` output of flwr 1.24.0; the PyTorch one loads a
generated CIFAR-shaped data set instead of downloading CIFAR-10, the NumPy one has no data).
Every run of an app gets the same number of clients, the same partitions (``partition-id`` i of
``num-partitions`` N, the app's own split), the same run config (the app's
``[tool.flwr.app.config]`` with the same ``--run-config`` overrides: the rounds) and the same
initial model (the app's ``ServerApp`` builds it after ``torch.manual_seed(seed)``). Each run is
a fresh process:

* **flwr** — Flower's simulation runtime as ``flwr run`` starts it for a local-simulation
  federation (``flwr.simulation.run_simulation``'s engine with the app directory, its
  ``ServerApp`` and its fused run config), Ray backend, one CPU per client. The ``ServerApp``
  (the template's ``FedAvg``) runs unchanged and writes its final model to
  ``final_model.pt`` / ``final_model.npz``, which is what is measured. Flower has no per-message
  seed, so for reruns to repeat, each ClientApp message runs after torch, numpy and Python's
  generators are seeded from (seed, partition, round, message type) -- as Murmura seeds each of
  its tasks -- and the SuperNodes' ids (which decide whom ``FedAvg`` samples) are drawn from a
  seeded generator.
* **murmura simulate** -- :class:`~murmura.simulation.flower.FlowerSimulation`, what
  ``murmura simulate --flower-app APP --clients N --seed S --run-config ...`` runs (sync
  rounds; ``fraction-train`` becomes the cohort fraction); the final model is the run's.
* **murmura run** (the PyTorch app, not under ``--smoke``) -- ``murmura run --flower-app APP``
  itself: an aggregator and N client processes over loopback gRPC; the final model is
  ``OUT/checkpoint.npz``.

**Accuracy.** Every final model is measured the same way, with the app's own ``evaluate``
handler: the federated evaluation Flower's ``FedAvg`` reports after its last round
(``fraction-evaluate`` 1.0: every partition's test split, weighted by ``num-examples``), and the
central one Murmura's server reports (partition 0 of 1). The target compares the federated
accuracy's mean over the seeds. The NumPy template learns nothing (each client adds U(0, 1)
noise to the one-number model, and evaluates nothing), so its measure is the final model's
value, expected 1 + rounds / 2 on both sides; its target is that the two means differ by at most
three standard deviations of that noise.

Run ``python benchmarks/flower_apps.py [--quick | --smoke]``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress  # noqa: E402

NAME = "flower_apps"
ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "tests" / "flower" / "apps"
#: A worker's last stdout line is its JSON result.
WORKER_TIMEOUT_S = 900
#: How often a Flower run that lost replies is run again.
RETRIES = 2
#: Accuracy metric names an evaluate handler may report, in order of preference.
ACCURACY_KEYS = ("accuracy", "eval_acc", "eval_accuracy", "acc")


@dataclass(frozen=True)
class Plan:
    """One app's runs: every side, every seed."""

    app: str
    clients: int
    rounds: int
    seeds: tuple[int, ...]
    extra: str = ""       # further --run-config overrides (on every side)
    grpc: bool = False    # also `murmura run` (real gRPC clients)
    target: bool = True   # checked against the 2-point target (else reported only)

    @property
    def run_config(self) -> str:
        return " ".join(filter(None, [f"num-server-rounds={self.rounds}", self.extra]))

    @property
    def label(self) -> str:
        return f"{self.app} ({self.run_config})"


#: The PyTorch template's own lr (0.01, Adam, from scratch) leaves some runs at chance for
#: many rounds on either side (see the notes); the target runs use a learning rate at which
#: no run stays there, and the template's own config is reported alongside.
STABLE_LR = "lr=0.003"
#: Below this federated accuracy a PyTorch run counts as one that stayed at chance (0.1).
AT_CHANCE = 0.2


def plans(quick: bool, smoke: bool) -> list[Plan]:
    if smoke:
        return [Plan("quickstart-pytorch", 4, 1, (0,), STABLE_LR),
                Plan("quickstart-numpy", 2, 1, (0,))]
    if quick:
        return [Plan("quickstart-pytorch", 4, 3, (0, 1), STABLE_LR),
                Plan("quickstart-numpy", 10, 3, (0,))]
    return [Plan("quickstart-pytorch", 4, 5, (0, 1, 2), STABLE_LR, grpc=True),
            Plan("quickstart-pytorch", 4, 3, (0, 1, 2), target=False),
            Plan("quickstart-numpy", 10, 3, tuple(range(8)))]  # cheap: more seeds, tighter


# -- measuring a final model ---------------------------------------------------------------------


def _flat(trainer: Any, arrays: dict[str, Any]) -> Any:
    """``arrays`` (name -> array) as ``trainer``'s flat vector."""
    import numpy as np

    missing = [t.name for t in trainer.spec.tensors if t.name not in arrays]
    if missing:
        raise SystemExit(f"the final model lacks arrays {missing[:3]}")
    return np.concatenate([np.asarray(arrays[t.name], dtype=np.float32).reshape(-1)
                           for t in trainer.spec.tensors])


def measure(app: Path, clients: int, run_config: str, arrays: dict[str, Any]) -> dict[str, Any]:
    """The final model through the app's own evaluate handler: federated (every partition of
    ``clients``, weighted by num-examples) and central (partition 0 of 1); for an app whose
    handler reports no accuracy, the mean of the model's values."""
    import numpy as np

    from murmura.client.flower_load import load_flower_client

    central = load_flower_client(str(app), client_index=0, num_clients=1,
                                 run_config_overrides=run_config)
    flat = _flat(central, arrays)
    out: dict[str, Any] = {"model_mean": float(np.mean(flat))}
    if not getattr(central, "has_evaluate", False):
        return out
    n, metrics = central.evaluate(flat)
    acc = next((metrics[k] for k in ACCURACY_KEYS if k in metrics), None)
    if acc is None:  # the handler reports something else (the NumPy template)
        return out
    out["central_acc"] = float(acc)
    total = weighted = 0.0
    for i in range(clients):
        trainer = load_flower_client(str(app), client_index=i, num_clients=clients,
                                     run_config_overrides=run_config)
        n, metrics = trainer.evaluate(flat)
        total += n
        weighted += n * next(metrics[k] for k in ACCURACY_KEYS if k in metrics)
    out["federated_acc"] = weighted / total
    return out


# -- the sides (each in its own process) ---------------------------------------------------------


class SeededClientApp:
    """The app's ClientApp, each message run after seeding the global generators from (seed,
    partition, round, message type), as Murmura seeds each task. Pickled by reference to
    this module, so Ray workers import the app themselves (once per worker)."""

    def __init__(self, ref: str, root: str, seed: int) -> None:
        super().__init__()  # ClientApp's own fields, in the flwr subclass
        self.ref, self.root, self.seed = ref, root, seed
        self._app: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"ref": self.ref, "root": self.root, "seed": self.seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["ref"], state["root"], state["seed"])  # type: ignore[misc]

    def __call__(self, message: Any, context: Any) -> Any:
        import random

        import numpy as np

        from murmura.client.flower_app import import_ref

        if self._app is None:
            self._app = import_ref(self.ref, Path(self.root))
        config = message.content.config_records.get("config", {})
        rnd = int(config.get("server-round", 0)) if hasattr(config, "get") else 0
        kind = {"train": 1, "evaluate": 2}.get(message.metadata.message_type.split(".")[0], 3)
        pid = int(context.node_config.get("partition-id", 0))
        seed = int(np.random.SeedSequence([self.seed, pid, rnd, kind]).generate_state(1)[0])
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        return self._app(message, context)


def _client_app_type() -> Any:
    """:class:`SeededClientApp` as a ``flwr.clientapp.ClientApp`` (Flower's runtime wants
    one), made on first use so that importing this module needs no flwr; kept as the module's
    ``SeededFlowerClientApp``, so it pickles by reference."""
    cls = globals().get("SeededFlowerClientApp")
    if cls is None:
        from flwr.clientapp import ClientApp

        class SeededFlowerClientApp(SeededClientApp, ClientApp):  # type: ignore[misc]
            pass

        SeededFlowerClientApp.__qualname__ = "SeededFlowerClientApp"
        cls = globals()["SeededFlowerClientApp"] = SeededFlowerClientApp
    return cls


def __getattr__(name: str) -> Any:  # Ray workers unpickle SeededFlowerClientApp by name
    if name == "SeededFlowerClientApp":
        return _client_app_type()
    raise AttributeError(name)


class _LostReplies(logging.Handler):
    """Counts the replies Flower's FedAvg received as errors (a ClientApp run that failed in
    its Ray worker), from its ``aggregate_*`` log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"Received \d+ results and (\d+) failures", record.getMessage())
        if found:
            self.count += int(found.group(1))


def flwr_side(app: Path, clients: int, seed: int, run_config: str) -> dict[str, Any]:
    """Flower's simulation runtime on the app, as ``flwr run`` drives it (module docstring)."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import random

    import numpy as np
    import ray
    import torch
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.corestate import utils as corestate_utils
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supercore.telemetry import EventType

    from murmura.client.flower_app import parse_run_config, read_project

    app = app.resolve()  # the run changes directory
    project = read_project(app / "pyproject.toml")
    overrides = parse_run_config(run_config)
    fused = get_fused_config_from_dir(app, overrides)
    # SuperNode ids decide whom FedAvg samples (a set of random ints): draw them seeded
    ids = random.Random(seed)
    corestate_utils.urandom = ids.randbytes  # type: ignore[attr-defined]
    sys.path.insert(0, str(app))
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    run = Run.create_empty(run_id=1)
    run.override_config = overrides
    run.primary_task_id = 1
    run.federation_id = NOOP_FEDERATION_ID
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # SuperLink's
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=fused)
    client_app = _client_app_type()(project.clientapp, str(app), seed)
    lost = _LostReplies()  # FedAvg's "Received N results and M failures" lines
    logging.getLogger("flwr").addHandler(lost)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # the ServerApp's initial model, as Murmura's probe seeds it
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)  # the ServerApp writes its final model to the working directory
        try:
            t0 = time.perf_counter()
            _run_simulation(server_app_attr=project.serverapp, client_app=client_app,
                            num_supernodes=clients, backend_name="ray",
                            backend_config={"client_resources": {"num_cpus": 1,
                                                                 "num_gpus": 0.0}},
                            app_dir=str(app), run=run, server_app_context=context,
                            is_app=True, exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE)
            wall = time.perf_counter() - t0
        finally:
            os.chdir(here)
        if (Path(work) / "final_model.pt").is_file():
            state = torch.load(Path(work) / "final_model.pt")
            arrays = {k: v.numpy() for k, v in state.items()}
        elif (Path(work) / "final_model.npz").is_file():
            with np.load(Path(work) / "final_model.npz") as f:
                arrays = {k.removeprefix("arr_"): f[k] for k in f.files}
        else:
            raise SystemExit(f"the ServerApp wrote no final model: {os.listdir(work)}")
    ray.shutdown()
    return {"run_s": wall, "lost_replies": lost.count,
            **measure(app, clients, run_config, arrays)}


def murmura_side(app: Path, clients: int, seed: int, run_config: str) -> dict[str, Any]:
    """``murmura simulate --flower-app`` on the app (its Python form)."""
    from murmura.server import ServerConfig
    from murmura.simulation import SimulationConfig
    from murmura.simulation.api import prepare_server
    from murmura.simulation.flower import FlowerSimulation

    with tempfile.TemporaryDirectory() as out:
        sim = SimulationConfig(clients=clients, out=out)
        server = prepare_server(ServerConfig.from_flat(seed=seed), sim)
        t0 = time.perf_counter()
        engine = FlowerSimulation(str(app), server, sim, run_config=run_config)
        result = engine.run()
        wall = time.perf_counter() - t0
        trainer = engine._app_trainer
        views = trainer.spec.unflatten(result.params)
    out_row = {"run_s": wall, "versions": result.version,
               "murmura_central_acc": result.final_accuracy,
               "cohort": engine.server_config.policy.cohort_fraction}
    return {**out_row, **measure(app, clients, run_config, dict(views))}


def murmura_run_side(app: Path, clients: int, seed: int, run_config: str) -> dict[str, Any]:
    """``murmura run --flower-app`` (an aggregator and client processes over gRPC)."""
    from murmura.client.flower_load import load_flower_client
    from murmura.server.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "murmura", "run", "--flower-app", str(app), "--clients",
             str(clients), "--seed", str(seed), "--run-config", run_config, "--out", out,
             "-q", "--timeout-s", str(WORKER_TIMEOUT_S - 60)],
            capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"murmura run failed ({done.returncode}): {done.stderr[-800:]}")
        params = load_checkpoint(Path(out) / "checkpoint.npz").params
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text()
                .splitlines()]
    trainer = load_flower_client(str(app), run_config_overrides=run_config)
    views = trainer.spec.unflatten(params)
    return {"run_s": wall, "versions": rows[-1]["version"],
            "murmura_central_acc": rows[-1].get("accuracy"),
            **measure(app, clients, run_config, dict(views))}


SIDES = {"flwr": flwr_side, "murmura": murmura_side, "murmura-run": murmura_run_side}


def _worker(argv: list[str]) -> None:
    import traceback

    logging.basicConfig(level=logging.WARNING)
    side, app, clients, seed, run_config = argv
    try:
        out = SIDES[side](Path(app), int(clients), int(seed), run_config)
    except BaseException:  # noqa: BLE001 - a failed Flower run leaves its ServerApp thread
        traceback.print_exc()  # waiting for replies: leave at once, with Ray's processes
        sys.stderr.flush()
        try:
            import ray

            ray.shutdown()
        finally:
            os._exit(1)
    print(json.dumps(out), flush=True)


def run_side(side: str, plan: Plan, seed: int) -> dict[str, Any]:
    """One side's run of ``plan`` with ``seed`` in a fresh process; its JSON result, with the
    process's wall time (start-up and evaluation included) as ``process_s``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    code = "import sys; from benchmarks.flower_apps import _worker; _worker(sys.argv[1:])"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, side, str(APPS / plan.app),
                           str(plan.clients), str(seed), plan.run_config],
                          cwd=ROOT, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
                          check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise SystemExit(f"{side} on {plan.app} (seed {seed}) failed ({done.returncode}):\n"
                         f"{tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


# -- the benchmark ---------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def run(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, "Flower's quickstart apps on Murmura against Flower's simulation "
                      "runtime: accuracy and wall time", argv)
    todo = plans(args.quick, args.smoke)
    report = Report(NAME, quick=args.quick, params={"runs": [
        {"app": p.app, "clients": p.clients, "rounds": p.rounds, "seeds": list(p.seeds),
         "run_config": p.run_config, "murmura_run": p.grpc and not args.smoke,
         "target": p.target} for p in todo]})
    summary: list[dict[str, Any]] = []
    detail: list[dict[str, Any]] = []
    retried: list[str] = []
    for plan in todo:
        sides = ["flwr", "murmura"] + (["murmura-run"] if plan.grpc and not args.smoke else [])
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        for seed in plan.seeds:
            for side in sides:
                progress(f"{plan.label}: {side}, {plan.clients} clients, seed {seed}")
                r = run_side(side, plan, seed)
                for _ in range(RETRIES):
                    if not r.get("lost_replies"):
                        break
                    progress(f"  Flower lost {r['lost_replies']} replies (a ClientApp run "
                             f"failed in its Ray worker); running it again")
                    retried.append(f"{plan.label} seed {seed} ({r['lost_replies']} lost)")
                    r = run_side(side, plan, seed)
                results[side].append(r)
                shown = r.get("federated_acc", r["model_mean"])
                progress(f"  {'federated accuracy' if 'federated_acc' in r else 'model'} "
                         f"{shown:.4f}, run {r['run_s']:.1f} s, process {r['process_s']:.1f} s")
                detail.append({"app": plan.app, "run_config": plan.run_config, "seed": seed,
                               "side": side, **r})
        summary += _summarise(report, plan, results)
    cols = [Column("app", "app"), Column("run_config", "--run-config"),
            Column("clients", "clients"), Column("seeds", "seeds"), Column("side", "run"),
            Column("measure", "measure"),
            Column("value", "mean", "{:.4f}"), Column("sd", "sd", "{:.4f}"),
            Column("diff", "vs flwr", "{:+.2f}"),
            Column("central", "central acc", "{:.4f}"),
            Column("at_chance", "runs at chance"),
            Column("run_s", "run s", "{:.1f}"), Column("process_s", "process s", "{:.1f}")]
    report.table("Final model after the last round (mean over seeds)", cols, summary)
    dcols = [Column("app", "app"), Column("run_config", "--run-config"), Column("seed", "seed"),
             Column("side", "run"), Column("federated_acc", "federated acc", "{:.4f}"),
             Column("central_acc", "central acc", "{:.4f}"),
             Column("model_mean", "model mean", "{:.4f}"),
             Column("run_s", "run s", "{:.1f}"), Column("process_s", "process s", "{:.1f}")]
    report.table("Every run", dcols, detail)
    report.note(
        "Same app, data partitions, clients, run config (the app's, with the `--run-config` "
        "shown on every side) and initial model on every side; each run a fresh process. "
        "flwr: Flower's simulation runtime as `flwr run` starts it (Ray backend, one CPU per "
        "client), the app's ServerApp (FedAvg, fraction-train from its config) unchanged; "
        "murmura: `murmura simulate --flower-app` (sync rounds, fraction-train as the cohort "
        "fraction); murmura-run: `murmura run --flower-app` with client processes over "
        "loopback gRPC. Accuracy is the app's own evaluate handler on the final model: "
        "federated (every partition's test split, weighted by num-examples, as FedAvg reports "
        "it) and central (partition 0 of 1, as Murmura's server reports it). 'vs flwr' is in "
        "accuracy points (for the NumPy template, in the model's units). run s: the training "
        "run alone; process s: the whole process (imports, Ray start, evaluation). The "
        "machine is shared: wall times move with its load (in the header).")
    report.note(
        "The PyTorch template at its own lr 0.01 (Adam, from scratch, on the generated data) "
        "leaves some runs at chance accuracy for many rounds, on either side and from any "
        "initial model: the mean over a few seeds then says how many runs stayed there, not "
        f"how the two compare. The targets are therefore taken at {STABLE_LR} (no run stays "
        "at chance), and the template's own config is reported without a target. The NumPy "
        "template learns nothing: each client adds U(0, 1) noise to the one-number model, so "
        "its final value is 1 + rounds/2 on average on both sides and its target is that the "
        "means differ by at most 3 standard deviations of that noise.", after_tables=True)
    if retried:
        report.note("Flower runs that lost replies (FedAvg aggregated without them) and were "
                    "run again: " + "; ".join(retried) + ".", after_tables=True)
    return report.finish(save=not args.no_save)


def _summarise(report: Report, plan: Plan, results: dict[str, list[dict[str, Any]]]
               ) -> list[dict[str, Any]]:
    accuracy = all("federated_acc" in r for rs in results.values() for r in rs)
    key = "federated_acc" if accuracy else "model_mean"
    flwr = _mean([r[key] for r in results["flwr"]])
    rows = []
    for side, rs in results.items():
        values = [r[key] for r in rs]
        value = _mean(values)
        scale = 100.0 if accuracy else 1.0
        rows.append({
            "app": plan.app, "run_config": plan.run_config, "clients": plan.clients,
            "seeds": len(plan.seeds), "side": side,
            "measure": "federated accuracy" if accuracy else "final model value",
            "value": value, "sd": statistics.stdev(values) if len(values) > 1 else None,
            "diff": None if side == "flwr" else (value - flwr) * scale,
            "central": _mean([r["central_acc"] for r in rs]) if accuracy else None,
            "at_chance": (f"{sum(v < AT_CHANCE for v in values)} of {len(values)}"
                          if accuracy else None),
            "run_s": _mean([r["run_s"] for r in rs]),
            "process_s": _mean([r["process_s"] for r in rs])})
        if side == "flwr" or not plan.target:
            continue
        if accuracy:
            report.target(f"{plan.app}: federated accuracy, {side} against flwr",
                          abs(value - flwr) * 100, "<=", 2.0, unit="points",
                          detail=f"{plan.clients} clients, {plan.run_config}, mean of "
                                 f"{len(plan.seeds)} seeds: {value:.4f} vs {flwr:.4f}")
        else:
            # each round adds the mean of `clients` U(0, 1) draws (FedAvg, fraction 1)
            sd = math.sqrt(2 * plan.rounds / (12 * plan.clients * len(plan.seeds)))
            report.target(f"{plan.app}: final model value, {side} against flwr",
                          abs(value - flwr), "<=", 3 * sd,
                          detail=f"3 sd of the app's noise; {plan.clients} clients, "
                                 f"{plan.run_config}: {value:.3f} vs {flwr:.3f}, expected "
                                 f"{1 + plan.rounds / 2:.3f}")
    return rows


if __name__ == "__main__":
    sys.exit(run())
